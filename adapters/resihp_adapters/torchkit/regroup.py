"""How a plan generation gets its communicators: derived from a surviving group where the
backend can, rebuilt where it cannot (docs/gpu.md, "Communicators per generation").

Creating communicators is the expensive part of a reconfiguration at scale (an NCCL
world takes seconds on one node and minutes at thousands of GPUs). So a generation's
world is, in order of preference:

* ``shrink``: the members are a subset of the live world's, and the backend shrinks a
  communicator (NCCL >= 2.27 through ``torch.distributed.shrink_group``): the left-out
  ranks (dead or excluded) take no part; pending work on the parent is aborted;
* ``split`` / ``keep``: the members are exactly the live world's: the world is kept and
  only the TP / DP-chunk subgroups are made again. Under NCCL with the world bound to
  its device, torch makes each subgroup by ``ncclCommSplit`` of the world's
  communicator (``split``); gloo has no communicator to split, so each subgroup still
  connects its own mesh, but the world's rendezvous and mesh are saved (``keep``);
* ``rebuild``: everything else (a device joins, a member released its groups after a
  failure, the members hold different worlds, the backend cannot shrink): every group
  is ended and the world made again under the new generation's rendezvous.

Deriving needs one more thing of the backend: a worker still blocked in a collective of
the live world when its generation is superseded must be released without the world
being closed, or its peers wait for its vote until its op timeout. Under NCCL the abort
watch does that (after a short grace in which an idle worker stops it and keeps its
world); gloo has no such release, only closed sockets, so under gloo every generation
is rebuilt (``keep`` is reached there only by passing capabilities, as tests do).

Every member must take the same path or they never meet: :func:`agree` has each member
vote its live world's identity in the new generation's rendezvous, and a path other
than ``rebuild`` is taken only if all members voted the same one. :func:`choose` is the
pure rule, tested without processes or GPUs.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.distributed as dist

from resihp_core.runtime.session import rendezvous_store

__all__ = ["Path", "Capabilities", "Parent", "Choice", "probe", "choose", "agree", "GenerationRendezvous",
           "shrink_world", "NCCL_SHRINK_MIN"]

Path = Literal["shrink", "split", "keep", "rebuild"]

#: ``ncclCommShrink`` first shipped in NCCL 2.27.
NCCL_SHRINK_MIN = (2, 27, 0)


@dataclass(frozen=True)
class Capabilities:
    """What this process's torch and the live world's backend offer (:func:`probe`)."""

    backend: str  # "nccl" or "gloo": the backend that carries the wire tensors
    torch_shrink: bool = False  # torch.distributed.shrink_group exists
    backend_shrinks: bool = False  # the world's backend reports supports_shrinking
    nccl_version: tuple[int, int, int] | None = None
    backend_splits: bool = False  # the world is bound to a device whose backend splits
    # A worker blocked in a collective on the live world is released once its generation
    # is superseded (NCCL: the abort watch). Without that, a kept world would hold such a
    # worker until its op timeout while its peers wait for its vote; a rebuild closes
    # the world at once (gloo ends pending work when the peer's sockets close).
    releases_blocked: bool = False

    @property
    def can_shrink(self) -> bool:
        if not (self.torch_shrink and self.backend_shrinks):
            return False
        return self.backend != "nccl" or (self.nccl_version is not None and self.nccl_version >= NCCL_SHRINK_MIN)

    def why_not_shrink(self) -> str:
        if not self.torch_shrink:
            return f"torch {torch.__version__} has no shrink_group"
        if not self.backend_shrinks:
            return f"{self.backend} does not support shrinking"
        return f"NCCL {self.nccl_version} < {'.'.join(map(str, NCCL_SHRINK_MIN))}"


@dataclass(frozen=True)
class Parent:
    """The live world a worker holds: the generation that made it, its members (sorted
    devices: rank = index) and torch's group counter (subgroup names come from it, so
    members must agree on it to meet in the next subgroups)."""

    generation: int
    devices: tuple[int, ...]
    group_count: int

    def token(self) -> str:
        text = f"{self.generation}:{','.join(map(str, self.devices))}:{self.group_count}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Choice:
    """The path taken and why; ``excluded``: the parent's ranks a shrink leaves out."""

    path: Path
    reason: str
    excluded: tuple[int, ...] = ()


def choose(caps: Capabilities, parent: Parent | None, devices: Sequence[int], agreed: bool) -> Choice:
    """The cheapest path to a world over ``devices`` from ``parent`` (None: no live
    world); ``agreed``: every member holds this same parent (:func:`agree`)."""
    new = tuple(sorted(devices))
    if not caps.releases_blocked:
        return Choice("rebuild", f"{caps.backend}: a peer blocked in the live world is released only by closing it")
    if parent is None:
        return Choice("rebuild", "no live group to derive from")
    if not agreed:
        return Choice("rebuild", "the members do not all hold the same live group")
    if new == parent.devices:
        if caps.backend_splits:
            return Choice("split", f"same members: world kept, subgroups split from it ({caps.backend})")
        return Choice("keep", f"same members: world kept, subgroups made anew ({caps.backend} cannot split)")
    if not set(new) < set(parent.devices):
        joined = sorted(set(new) - set(parent.devices))
        return Choice("rebuild", f"device(s) {joined} join: not in the live group")
    excluded = tuple(i for i, d in enumerate(parent.devices) if d not in set(new))
    if caps.can_shrink:
        return Choice("shrink", f"{len(excluded)} rank(s) left out: world shrunk", excluded)
    return Choice("rebuild", f"{len(excluded)} rank(s) left out and {caps.why_not_shrink()}")


def _nccl_version() -> tuple[int, int, int] | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        return None
    return tuple(v) if isinstance(v, tuple) else (v // 1000, v % 1000 // 100, v % 100)  # type: ignore[return-value]


def probe(backend: str) -> Capabilities:
    """The capabilities of this process's live world (``backend``: the wire backend);
    without a live world only torch's own are known."""
    torch_shrink = hasattr(dist.distributed_c10d, "shrink_group")
    nccl = _nccl_version() if backend == "nccl" else None
    shrinks = splits = False
    if dist.is_initialized():
        pg = dist.distributed_c10d._get_default_group()
        bound = getattr(pg, "bound_device_id", None)
        device = bound if bound is not None else torch.device("cuda" if backend == "nccl" else "cpu")
        try:
            impl = pg._get_backend(device)
            shrinks = bool(getattr(impl, "supports_shrinking", False))
            splits = bound is not None and bool(getattr(impl, "supports_splitting", False))
        except RuntimeError:
            pass
    releases = backend == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group")
    return Capabilities(backend, torch_shrink, shrinks, nccl, splits, releases)


def agree(store: dist.Store, generation: int, me: int, devices: Sequence[int], parent: Parent | None,
          timeout: datetime.timedelta) -> bool:
    """Vote ``parent`` in generation ``generation``'s rendezvous and wait for every
    member's vote: True when all voted the same live group. Every member computes the
    same answer: each adds to the counter of its own token before it says it voted, so
    once all have said so the counts are final, and no count reaches ``len(devices)``
    unless every vote went to it."""
    rdv = dist.PrefixStore("regroup/", rendezvous_store(store, generation))
    token = parent.token() if parent is not None else "none"
    rdv.add(f"t/{token}", 1)
    rdv.set(f"v/{me}", token)
    rdv.wait([f"v/{d}" for d in devices], timeout)
    return parent is not None and rdv.add(f"t/{token}", 0) == len(devices)


class GenerationRendezvous(dist.Store):
    """The store a world rendezvouses in: the job store under ``gen<g>/`` for a
    generation ``g`` that moves forward when the world is kept into a newer generation
    (:meth:`advance`). Every group made later from the world (subgroups, lazily created
    NCCL communicators, a shrunk world) rendezvouses under the newest generation, which
    the generation fence of the job store lets through; under the old prefix the fence
    would end their waits as superseded."""

    def __init__(self, inner: dist.Store, generation: int, cell: list[int] | None = None) -> None:
        super().__init__()
        self._inner = inner
        self._cell = cell if cell is not None else [generation]

    @property
    def generation(self) -> int:
        return self._cell[0]

    def advance(self, generation: int) -> None:
        self._cell[0] = generation

    def _k(self, key: str) -> str:
        return f"gen{self._cell[0]}/{key}"

    def clone(self) -> GenerationRendezvous:  # shrink_group clones its parent's store
        return GenerationRendezvous(self._inner, self._cell[0], self._cell)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:  # type: ignore[override]
        return self._inner.timeout

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        return self._inner.get(self._k(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._inner.multi_get([self._k(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._inner.multi_set([self._k(k) for k in keys], values)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(self._k(key), value)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._inner.compare_set(self._k(key), expected_value, desired_value)

    def append(self, key: str, value: str | bytes) -> None:
        self._inner.append(self._k(key), value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        keys = [self._k(k) for k in keys]
        self._inner.wait(keys, timeout) if timeout is not None else self._inner.wait(keys)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check([self._k(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self._k(key))

    def num_keys(self) -> int:
        return self._inner.num_keys()


def shrink_world(excluded: Sequence[int]) -> float:
    """Shrink the default group to the ranks not in ``excluded`` (torch's shrink_group,
    aborting pending work on the parent: a survivor may still have some queued with a
    dead peer); every other group is ended by torch. Returns the seconds it took."""
    c10d = dist.distributed_c10d
    t0 = time.perf_counter()
    c10d.shrink_group(list(excluded), shrink_flags=c10d.SHRINK_ABORT)
    return time.perf_counter() - t0
