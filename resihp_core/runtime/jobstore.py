"""The job's control keys in the controller-hosted job store, one place for both sides.

Every connection to the job store goes through :func:`connect` (workers) and
:func:`host` (the controller): an authenticated store bound to the address the user
chose (:mod:`resihp_core.runtime.store`; docs/security.md). Workers may not write the
``plan/`` keys.

The whole worker protocol (keys, commit/abort, ``RESIHP_*`` variables) is written down
in ``docs/worker-protocol.md``. Keys (generation ``g``):

- ``plan/latest``: the newest generation number; ``plan/<g>``: the generation's
  :class:`~resihp_core.protocol.PlanUpdate`, msgpack-encoded (the typed wire message,
  validated when read).
- ``gen<g>/...``: torch.distributed rendezvous of that generation (``PrefixStore``).
  Workers reach it through :func:`generation_fenced`: a wait on a ``gen<g>/`` key ends
  as soon as a newer generation is posted, so no worker lingers in a superseded
  rendezvous while its peers meet in the new one (docs/worker-protocol.md).
- ``ctl<g>/done<i>``: commit counter of iteration ``i``: each executor adds 1 after its
  optimizer step. ``ctl<g>/verdict<i>``: the executor whose add completes the count
  writes ``commit``, a coordinator aborting the generation writes ``abort``, both with
  an atomic compare-and-set on an absent key, so exactly one verdict exists and every
  worker and the coordinator read the same one.
- ``ctl<g>/ready/<device>``: reconfiguration done (JSON timings);
  ``ctl<g>/failed/<device>``: why this worker left the generation (a
  :class:`~resihp_core.protocol.WorkerLeft`, msgpack-encoded; its ``state_lost`` flag
  is the typed "restore from a checkpoint" signal);
  ``ctl<g>/report/<i>/<device>``: the :class:`~resihp_core.protocol.IterationReport`.
- ``worker/<device>/pid``: the worker's process id.
- ``controller/present``: set by the controller once it steers the job, dropped by a
  store host (its own process, docs/failover.md) when the controller's connection
  closes; a worker started with ``RESIHP_CONTROLLER_GRACE`` holds each commit until
  it exists. ``controller/shutdown``: the controller ends the
  store host. Workers may not write ``controller/`` keys.
"""

from __future__ import annotations

import datetime
import os
import re
import time
from typing import Any, Callable

from resihp_core.protocol import IterationReport, PlanUpdate, ProtocolError, WorkerLeft, decode, encode

__all__ = ["connect", "host", "post_plan", "wait_controller", "PRESENT_KEY", "SHUTDOWN_KEY", "ENV_GRACE",
           "latest_generation", "wait_generation", "read_plan",
           "commit", "CommitResult", "abort_generation", "put_report", "get_report", "put_left", "get_left",
           "generation_fenced", "rendezvous_generation", "Superseded"]


ENV_SECRET = "RESIHP_SECRET"  # the worker's node credential (never on a command line)
ENV_NODE = "RESIHP_NODE"
ENV_DEVICE = "RESIHP_DEVICE"


def host(address: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0, *,
         secret: str | None = None, nodes: set[int] | None = None) -> tuple[Any, str]:
    """Start the job store on the controller's side, bound to ``address`` only; returns
    it (as seen from this process: every key writable) and its ``host:port``.

    ``secret`` is the job secret the workers' node credentials derive from (default:
    ``RESIHP_SECRET``); ``nodes`` the node ids allowed to connect (None: any). The
    returned store's ``server`` attribute is the
    :class:`~resihp_core.runtime.store.StoreServer` (close it when the job ends).
    """
    from resihp_core.runtime.store import StoreServer

    secret = secret or os.environ.get(ENV_SECRET, "")
    if not secret:
        raise ValueError(f"the job store needs the job secret (pass secret= or set {ENV_SECRET})")
    server = StoreServer(address, secret, port, nodes=nodes)
    store = server.local(timeout_s)
    store.server = server  # type: ignore[attr-defined]
    return store, server.address


def connect(address: str, timeout_s: float = 30.0) -> Any:
    """A worker's connection to the job store at ``host:port`` (a ``torch.distributed.Store``).

    It authenticates as ``worker:<RESIHP_NODE>:<RESIHP_DEVICE>`` with the node
    credential in ``RESIHP_SECRET`` (set by the node agent or the local launcher) and
    checks that the store knows the job secret. ``timeout_s`` bounds connecting and
    every blocking request.
    """
    from resihp_core.runtime.store import StoreClient, worker_store_identity

    h, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"job store address {address!r} must be host:port")
    key = os.environ.get(ENV_SECRET, "")
    if not key:
        raise RuntimeError(f"no job-store credential: {ENV_SECRET} is not set")
    node = int(os.environ.get(ENV_NODE, "0"))
    device = int(os.environ.get(ENV_DEVICE, "0"))
    return StoreClient(address, key, worker_store_identity(node, device), timeout_s=timeout_s)


def post_plan(store: Any, msg: PlanUpdate) -> None:
    store.set(f"plan/{msg.generation}", encode(msg))
    store.set("plan/latest", str(msg.generation))


def latest_generation(store: Any) -> int:
    """Newest posted generation, -1 if none (never blocks)."""
    if not store.check(["plan/latest"]):
        return -1
    return int(store.get("plan/latest"))


def wait_generation(store: Any, after: int, timeout_s: float) -> int:
    """Block up to ``timeout_s`` until a generation newer than ``after`` is posted;
    returns the newest one (``after`` if none came). It blocks inside the store (on
    ``plan/<after+1>``, which is written before ``plan/latest``) instead of polling it,
    so an idle worker costs the controller nothing."""
    g = latest_generation(store)
    if g > after:
        return g
    try:
        store.wait([f"plan/{after + 1}"], datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - torch's stores raise DistStoreError on time-out
        return max(after, latest_generation(store))
    return max(after + 1, latest_generation(store))


def read_plan(store: Any, generation: int) -> PlanUpdate:
    """Generation ``generation``'s plan message; ``ValueError`` if it is malformed."""
    try:
        msg = decode(store.get(f"plan/{generation}"))
    except ProtocolError as e:
        raise ValueError(f"malformed plan message of generation {generation}: {e}") from None
    if not isinstance(msg, PlanUpdate) or msg.generation != generation:
        raise ValueError(f"plan/{generation} does not hold generation {generation}'s plan")
    return msg


class CommitResult:
    COMMITTED = "commit"
    ABORTED = "abort"


def _verdict(store: Any, generation: int, iteration: int, proposal: str) -> str:
    got = store.compare_set(f"ctl{generation}/verdict{iteration}", "", proposal)
    return got.decode() if isinstance(got, bytes) else str(got)


PRESENT_KEY = "controller/present"
SHUTDOWN_KEY = "controller/shutdown"
ENV_GRACE = "RESIHP_CONTROLLER_GRACE"


def wait_controller(store: Any, timeout_s: float) -> bool:
    """Block until a controller is connected to the (separately hosted) store; False
    if none came within ``timeout_s``."""
    try:
        store.wait([PRESENT_KEY], datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - torch's stores raise DistStoreError on time-out
        return bool(store.check([PRESENT_KEY]))
    return True


def commit(store: Any, generation: int, iteration: int, executors: int,
           poll_s: float = 0.0005, timeout_s: float = 600.0, hold_s: float = 0.0) -> str:
    """Add this executor to the iteration's commit counter and wait for the verdict.

    ``hold_s > 0``: the store is hosted outside the controller (docs/failover.md);
    while no controller is connected the iteration is held, not committed, for up to
    ``hold_s`` seconds, then aborted."""
    if hold_s > 0 and not wait_controller(store, hold_s):
        return _verdict(store, generation, iteration, CommitResult.ABORTED)
    if store.add(f"ctl{generation}/done{iteration}", 1) == executors:
        return _verdict(store, generation, iteration, CommitResult.COMMITTED)
    key = f"ctl{generation}/verdict{iteration}"
    get_within = getattr(store, "get_within", None)  # ResiHP's store: wait and read in one round trip
    try:
        # Block in the store rather than poll it: a poll per half millisecond per waiting
        # executor is real CPU in the controller's process, which serves the store.
        if get_within is not None:
            got = get_within(key, timeout_s)
        else:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
            got = store.get(key)
    except Exception:  # noqa: BLE001 - torch's stores raise DistStoreError on time-out
        if not store.check([key]):
            return _verdict(store, generation, iteration, CommitResult.ABORTED)
        got = store.get(key)
    return got.decode() if isinstance(got, bytes) else str(got)


def abort_generation(store: Any, generation: int, first: int) -> int:
    """Abort ``generation`` at its first uncommitted iteration (from ``first`` on);
    returns that iteration: every iteration before it committed everywhere."""
    i = first
    while _verdict(store, generation, i, CommitResult.ABORTED) == CommitResult.COMMITTED:
        i += 1
    return i


def put_report(store: Any, report: IterationReport) -> None:
    store.set(f"ctl{report.generation}/report/{report.iteration}/{report.device}", encode(report))


def get_report(store: Any, generation: int, iteration: int, device: int) -> IterationReport | None:
    key = f"ctl{generation}/report/{iteration}/{device}"
    if not store.check([key]):
        return None
    msg = decode(store.get(key))
    if not isinstance(msg, IterationReport):
        raise ValueError(f"{key} holds a {type(msg).__name__}, not an iteration report")
    return msg


def put_left(store: Any, left: WorkerLeft) -> None:
    """Say why a worker left generation ``left.generation``."""
    store.set(f"ctl{left.generation}/failed/{left.device}", encode(left))


def get_left(store: Any, generation: int, device: int) -> WorkerLeft | None:
    """Why ``device`` left ``generation`` (None: it did not). A value that is not a
    :class:`~resihp_core.protocol.WorkerLeft` (plain text) reads as a reason with no
    state-lost signal."""
    key = f"ctl{generation}/failed/{device}"
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        msg = decode(raw)
    except ProtocolError:
        msg = None
    if isinstance(msg, WorkerLeft):
        return msg
    return WorkerLeft(generation=generation, device=device, reason=bytes(raw).decode(errors="replace"))


# ------------------------------------------------------------------ rendezvous fence
_RENDEZVOUS_KEY = re.compile(r"^/*gen(\d+)/")


def rendezvous_generation(keys: list[str]) -> int | None:
    """The generation whose rendezvous ``keys`` belong to (``gen<g>/...``, as a
    ``PrefixStore`` writes them), or None for any other key."""
    for k in keys:
        m = _RENDEZVOUS_KEY.match(k)
        if m:
            return int(m.group(1))
    return None


class Superseded(RuntimeError):
    """A wait in generation ``g``'s rendezvous ended because a newer one was posted."""


_FENCED_CLASS: Any = None


def generation_fenced(store: Any, latest: Callable[[], int], *, patience_s: float,
                      poll_s: float = 0.2) -> Any:
    """The worker's job store as its adapter sees it: every operation passes through,
    except that a wait (``wait``, ``get``, ``multi_get``) on keys of generation ``g``'s
    rendezvous (``gen<g>/...``) is cut into ``poll_s`` slices and

    - ends with :class:`Superseded` (a ``DistStoreError``) within ``poll_s`` once
      ``latest()`` exceeds ``g``: a worker still meeting in a superseded generation
      leaves at once for the new one, instead of holding its new peers up for the
      store timeout;
    - otherwise waits ``max(timeout, patience_s)``: while its generation is current a
      slow peer (a loaded host) is worth waiting for; a dead one is reported by the
      Detector and its generation superseded, which ends the wait.

    Without this, peers of one generation can end up in different groups of it: one
    times out in group k (its key stays in the store) while a late peer passes group k
    on that key and waits in group k+1 for a peer that has left (docs/worker-protocol.md).
    """
    global _FENCED_CLASS
    if _FENCED_CLASS is None:
        _FENCED_CLASS = _fenced_class()
    return _FENCED_CLASS(store, latest, patience_s, poll_s)


def _fenced_class() -> type:
    import torch.distributed as dist

    class SupersededStoreError(Superseded, dist.DistStoreError):
        """Raised through torch.distributed: a store error, and :class:`Superseded`."""

    _superseded, _timeout = SupersededStoreError, dist.DistStoreError

    class GenerationFencedStore(dist.Store):
        def __init__(self, inner: Any, latest: Callable[[], int], patience_s: float, poll_s: float) -> None:
            super().__init__()
            self._inner, self._latest = inner, latest
            self._patience_s, self._poll_s = patience_s, poll_s
            self._timeout_s = _seconds(getattr(inner, "timeout", None), 300.0)

        def _fence(self, keys: list[str], timeout_s: float | None) -> None:
            """Wait for ``keys`` of a rendezvous, leaving when superseded."""
            g = rendezvous_generation(keys)
            if g is None:
                return
            budget = max(self._timeout_s if timeout_s is None else timeout_s, self._patience_s)
            deadline = time.monotonic() + budget
            while True:
                latest = self._latest()
                if latest > g:
                    raise _superseded(f"generation {g} was superseded by generation {latest} while "
                                      f"waiting in its rendezvous for {keys[:2]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _timeout(f"rendezvous of generation {g} timed out after {budget:.0f} s "
                                   f"waiting for keys {keys[:4]}")
                try:
                    self._inner.wait(keys, datetime.timedelta(seconds=min(self._poll_s, left)))
                    return
                except dist.DistStoreError as e:
                    if "timed out" not in str(e) and "timeout" not in str(e):
                        raise  # a lost connection, not a slice that ran out

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self._timeout_s = _seconds(timeout, self._timeout_s)

        @property
        def timeout(self) -> datetime.timedelta:  # type: ignore[override]
            return datetime.timedelta(seconds=self._timeout_s)

        def set(self, key: str, value: Any) -> None:
            self._inner.set(key, value)

        def get(self, key: str) -> bytes:
            self._fence([key], None)
            return self._inner.get(key)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self._fence(list(keys), None)
            return self._inner.multi_get(keys)

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            self._inner.multi_set(keys, values)

        def add(self, key: str, value: int) -> int:
            return self._inner.add(key, value)

        def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
            return self._inner.compare_set(key, expected_value, desired_value)

        def append(self, key: str, value: Any) -> None:
            self._inner.append(key, value)

        def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
            keys = list(keys)
            if rendezvous_generation(keys) is None:
                self._inner.wait(keys, timeout) if timeout is not None else self._inner.wait(keys)
                return
            self._fence(keys, None if timeout is None else _seconds(timeout, self._timeout_s))

        def check(self, keys: list[str]) -> bool:
            return self._inner.check(keys)

        def delete_key(self, key: str) -> bool:
            return self._inner.delete_key(key)

        def num_keys(self) -> int:
            return self._inner.num_keys()

    return GenerationFencedStore


def _seconds(timeout: Any, default: float) -> float:
    if timeout is None:
        return default
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return default if s <= 0 else s
