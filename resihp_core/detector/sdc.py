"""Silent data corruption: cross-replica fingerprints checked before an iteration commits
(docs/sdc.md).

Devices that must hold bit-identical state after the optimizer step (the DP replicas of
a stage with the same TP layout) each post a :class:`Fingerprint` of their shard
(parameters and optimizer state) before they add themselves to the iteration's commit
counter. The executor whose add completes the count runs :func:`commit_check` before it
writes the verdict: if two members of a group disagree, it writes an
:class:`SdcFinding` and the verdict ``abort``, so the corrupt update is rolled back on
every device exactly as any uncommitted iteration is.

On the controller, :class:`SdcMonitor` reads findings (and asks the detectors plugins
register with ``resihp_register_sdc_detectors``) and hands them to the supervisor as
:class:`SdcDetected` events; :class:`SdcArbiter` (pure, owned by the supervisor) decides:

- three or more replicas and a strict majority: the odd ones out are reported
  fail-stop with cause ``sdc`` (quarantined: fenced and planned around, back only
  through a repair);
- no majority (two replicas): the iteration is re-executed once with the same plan;
  if the re-execution commits the flip was transient and nothing is quarantined; if
  it disagrees again the arbiter refuses to guess and the job stops, naming the
  devices.

Where no replica shares a device's state (DP = 1, plain FSDP2 shards), the same post
carries the device's *range signals*: the L2 norm of its local reduced gradient at the
step and its loss. :class:`RangeWatch` judges each against the device's own recent
committed values; a value far outside them (or not finite) on a minority of the devices
aborts the iteration with a ``range`` finding. The arbiter re-executes it once: a
re-execution within range was a transient fault (nothing quarantined); a device out of
range again is quarantined.

This module imports no framework: fingerprints of tensors are computed by
:func:`tensor_digest`, which imports torch only when called.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol, Sequence, Union, runtime_checkable

from resihp_core.protocol import FailureReport
from resihp_core.runtime import session

if TYPE_CHECKING:
    import torch

    from resihp_core.plan import ParallelPlan
    from resihp_core.runtime.session import JobSession, KeyValueStore

__all__ = ["ENV_SDC", "ENV_COVERAGE", "ENV_STATE_ROUNDS", "STATE_ROUNDS", "coverage",
           "state_rounds", "windows", "Fingerprint", "SdcFinding", "SdcSuspect", "SdcView", "SdcDetector", "SdcDetected",
           "Quarantine", "Reexecute", "Refuse", "SdcDecision", "SdcArbiter", "SdcMonitor", "SdcGuard",
           "SnapshotFingerprint", "tensor_digest", "digest_windows", "window_sum", "seal", "copy_with_sums",
           "grad_norm", "same_layout_replicas", "compare", "commit_check", "enabled", "RangeWatch"]

logger = logging.getLogger("resihp.sdc")

#: ``RESIHP_SDC=0`` in a worker's environment turns the fingerprints off.
ENV_SDC = "RESIHP_SDC"

_INT_OF_SIZE = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


# ------------------------------------------------------------------ fingerprints
@dataclass(frozen=True)
class Fingerprint:
    """What one device says about its state after an iteration's optimizer step.

    :param group: devices posting the same ``group`` must hold bit-identical state (the
        adapter names it: stage, TP degree and rank, layer range).
    :param digest: the state's checksum (:func:`tensor_digest`).
    :param signals: the device's range signals this iteration (``grad_norm``,
        ``loss``); empty if its adapter reports none.
    :param anomaly: why :class:`RangeWatch` finds a signal out of range ("" if none).

    A device that shares its state with no replica posts ``group`` "" (its digest is not
    compared) with its signals only.
    """

    group: str
    digest: str
    signals: dict[str, float] = field(default_factory=dict)
    anomaly: str = ""

    def to_json(self) -> str:
        # json writes a non-finite float as NaN / Infinity and reads it back
        return json.dumps({"group": self.group, "digest": self.digest, "signals": self.signals,
                           "anomaly": self.anomaly})

    @classmethod
    def from_json(cls, text: str | bytes) -> Fingerprint:
        d = json.loads(text)
        return cls(str(d["group"]), str(d["digest"]), {str(k): float(v) for k, v in d.get("signals", {}).items()},
                   str(d.get("anomaly", "")))


#: ``RESIHP_SDC_COVERAGE=c`` (0 < c <= 1, default 1): each fingerprint reads a rotating
#: share ``c`` of every parameter tensor instead of all of it (docs/sdc.md, "Cost").
ENV_COVERAGE = "RESIHP_SDC_COVERAGE"

#: ``RESIHP_SDC_STATE_ROUNDS=R`` (an integer >= 1, default :data:`STATE_ROUNDS`): each
#: fingerprint reads a rotating ``1/R`` of every optimizer-state tensor, so every byte of
#: it is read once in any ``R`` consecutive iterations (docs/sdc.md, "Cost").
ENV_STATE_ROUNDS = "RESIHP_SDC_STATE_ROUNDS"
STATE_ROUNDS = 8

#: The shortest window, in elements: a tensor cut into parts is cut into parts at least
#: this long (a smaller tensor is one part, read in one of the turns). Reading 64 Ki
#: elements costs about what the call that reads them costs, and a model with many
#: tensors pays that call per tensor read in a turn.
MIN_WINDOW = 1 << 16


def coverage(env: Mapping[str, str] | None = None) -> float:
    """The share of each parameter tensor a fingerprint reads (``RESIHP_SDC_COVERAGE``);
    refused with a message naming the variable when it is not a number in (0, 1]."""
    env = os.environ if env is None else env
    text = env.get(ENV_COVERAGE, "1")
    try:
        c = float(text)
    except ValueError:
        c = float("nan")
    if not 0.0 < c <= 1.0:
        raise ValueError(f"{ENV_COVERAGE}={text!r}: expected a number in (0, 1] (the share of each parameter "
                         "tensor a fingerprint reads)")
    return c


def state_rounds(env: Mapping[str, str] | None = None) -> int:
    """In how many iterations a fingerprint reads every optimizer-state byte once
    (``RESIHP_SDC_STATE_ROUNDS``; 1: all of it every iteration); refused with a message
    naming the variable when it is not an integer >= 1."""
    env = os.environ if env is None else env
    text = env.get(ENV_STATE_ROUNDS, str(STATE_ROUNDS))
    try:
        r = int(text)
    except ValueError:
        r = 0
    if r < 1:
        raise ValueError(f"{ENV_STATE_ROUNDS}={text!r}: expected an integer >= 1 (in how many iterations a "
                         "fingerprint reads all of the optimizer state)")
    return r


def windows(env: Mapping[str, str] | None = None) -> tuple[float, int]:
    """What a worker's fingerprint reads: the share of each parameter tensor
    (:func:`coverage`) and in how many iterations all of the optimizer state
    (:func:`state_rounds`, or more where ``RESIHP_SDC_COVERAGE`` reads less per
    iteration: the state is never read faster than the parameters)."""
    share = coverage(env)
    return share, max(state_rounds(env), math.ceil(1.0 / share))


def tensor_digest(named: Iterable[tuple[str, torch.Tensor]], *, share: float = 1.0, turn: int = 0,
                  state: Iterable[tuple[str, torch.Tensor]] = (), rounds: int = 1) -> str:
    """A checksum of the exact bits of ``named`` tensors (whole, or a window of
    ``share`` of each) and of a window of ``1/rounds`` of each ``state`` tensor.

    Each tensor's elements are read as 64-bit words (consecutive elements by index, so
    the words do not depend on where the tensor sits in memory; the few elements after
    the last whole word one by one) and summed in wrapping arithmetic: the sum does not
    depend on the order of the reduction, so it is the same on every device holding the
    same bits, and a single flipped bit changes it (by 2**b). One device-to-host copy
    for all tensors; the per-tensor sums, sizes and names are hashed. A tensor that is
    the same memory as one read before (the same start, size, strides and type) is read
    once.

    Windows are a function of ``turn`` (the optimizer step: the same on every replica
    that compares) and of the tensor's size and position: ``named`` tensors are cut into
    ``ceil(1 / share)`` parts and part ``turn`` of them is read; ``state`` tensor ``j``
    into ``rounds`` parts and part ``turn + j`` (staggered, so each turn reads about
    ``1/rounds`` of the state), both modulo the number of parts. Parts are at least
    :data:`MIN_WINDOW` elements long, so a small tensor has fewer parts than turns and is
    read in one turn out of ``rounds``. Any ``rounds`` consecutive turns read every byte
    of the state once.

    :func:`digest_windows`, :func:`window_sum` and :func:`seal` are its three steps, for
    a caller that reads the windows as part of another pass over the same memory (the
    torch_native rollback snapshot, docs/sdc.md "What it costs")."""
    labels, views = digest_windows(named, share=share, turn=turn, state=state, rounds=rounds)
    import torch

    with torch.no_grad():
        return seal(labels, [window_sum(v) for v in views])


def digest_windows(named: Iterable[tuple[str, torch.Tensor]], *, share: float = 1.0, turn: int = 0,
                   state: Iterable[tuple[str, torch.Tensor]] = (), rounds: int = 1
                   ) -> tuple[list[str], list[torch.Tensor]]:
    """What :func:`tensor_digest` reads: the labels it hashes and the 1-D views (in the
    same order) whose :func:`window_sum` it hashes with them. Views, not copies."""
    import torch

    names: list[str] = []
    views: list[torch.Tensor] = []
    seen: set[tuple[object, ...]] = set()
    k = math.ceil(1.0 / share)
    parts = [(name, t, k, turn % k) for name, t in named]
    parts += [(name, t, rounds, (turn + j) % rounds) for j, (name, t) in enumerate(state)]
    with torch.no_grad():  # no autograd views of parameters
        for name, t, of, part in parts:
            n = t.numel()
            key = (t.device, t.dtype, t.data_ptr(), t.shape, t.stride()) if n else None
            if key is not None and key in seen:
                names.append(f"{name}=alias")
                continue
            if key is not None:
                seen.add(key)
            flat = t if t.dim() == 1 else t.reshape(-1)
            es = t.element_size()
            if of > 1:
                per = max(1, 8 // es)  # whole 64-bit words: no window starts mid-word
                size = max(-(-n // (of * per)) * per, MIN_WINDOW)
                names.append(f"{name}:{n}[{part}/{of}]")
                if part * size >= n:
                    continue  # this turn's part of a small tensor is empty
                flat = flat[part * size:(part + 1) * size]
            else:
                names.append(f"{name}:{n}")
            views.append(flat)
    return names, views


def window_sum(flat: torch.Tensor) -> torch.Tensor:
    """The wrapping 64-bit sum of the bits of ``flat`` (1-D), as :func:`tensor_digest`
    counts them; sums of consecutive pieces of a window add up to the window's (in
    wrapping arithmetic) when each piece holds whole 64-bit words."""
    import torch

    es = flat.element_size()
    if (flat.numel() * es) % 8 == 0 and (flat.storage_offset() * es) % 8 == 0 and flat.is_contiguous():
        return flat.view(torch.int64).sum()  # whole aligned words: _bit_sum's common case inline
    return _bit_sum(flat)


#: Bytes :func:`copy_with_sums` copies before it sums them: small enough to be read
#: again from the cache, large enough that the per-piece calls cost little.
COPY_PIECE_BYTES = 4 << 20
#: Sources smaller than this are copied in one batch and their windows summed after:
#: reading them again costs less than a copy call of their own.
FUSE_MIN_BYTES = 1 << 20


def copy_with_sums(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                   views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy each of ``srcs`` into ``dsts`` (as ``torch._foreach_copy_``) and return the
    :func:`window_sum` of each of ``views`` (windows of the sources, :func:`digest_windows`).

    A view that lies inside a contiguous source is summed piece by piece right after
    each piece is copied, while the copy has left it in the cache: a fingerprint taken
    this way costs a fraction of a separate pass over the same memory (docs/sdc.md "What
    it costs"). Pieces hold whole 64-bit words counted from the view's start, so their
    sums add up to the view's. Any other view (of a source under :data:`FUSE_MIN_BYTES`,
    or of none) is summed after the copy."""
    import bisect

    import torch

    located: dict[int, list[tuple[int, int, int]]] = {}  # source -> (first, end, view) in elements
    order = sorted((t.data_ptr(), k) for k, t in enumerate(srcs)
                   if t.numel() * t.element_size() >= FUSE_MIN_BYTES and t.is_contiguous())
    starts = [p for p, _ in order]
    for vi, v in enumerate(views):
        at = bisect.bisect_right(starts, v.data_ptr()) - 1
        if at < 0 or not v.numel() or not v.is_contiguous():
            continue
        k = order[at][1]
        src, dst = srcs[k], dsts[k]
        es = src.element_size()
        off, rest = divmod(v.data_ptr() - src.data_ptr(), es)
        if (rest or v.dtype != src.dtype or v.device != src.device or off + v.numel() > src.numel()
                or not dst.is_contiguous() or dst.shape != src.shape):
            continue
        located.setdefault(k, []).append((off, off + v.numel(), vi))
    for k, spans in list(located.items()):
        spans.sort()
        if any(b > c for (_, b, _), (c, _, _) in zip(spans, spans[1:])):
            del located[k]  # overlapping windows of one source: summed after the copy
    plain = [k for k in range(len(srcs)) if k not in located]
    if plain:
        torch._foreach_copy_([dsts[k] for k in plain], [srcs[k] for k in plain])
    sums: list[torch.Tensor | None] = [None] * len(views)
    for k, spans in located.items():
        src, dst = srcs[k].reshape(-1), dsts[k].view(-1)
        es = src.element_size()
        words = max(1, 8 // es)
        step = max(words, COPY_PIECE_BYTES // es // words * words)
        done = 0
        for first, end, vi in spans:
            if first > done:
                dst[done:first].copy_(src[done:first])
            parts = []
            for a in range(first, end, step):
                b = min(a + step, end)
                dst[a:b].copy_(src[a:b])
                parts.append(window_sum(src[a:b]))
            sums[vi] = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
            done = end
        if done < src.numel():
            dst[done:].copy_(src[done:])
    return [t if t is not None else window_sum(views[vi]) for vi, t in enumerate(sums)]


def seal(labels: Sequence[str], sums: Sequence[torch.Tensor]) -> str:
    """The digest of ``labels`` and the windows' sums (:func:`digest_windows`)."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    h.update("|".join(labels).encode())
    if sums:
        dev = sums[0].device  # a copy only for a sum on another device (a host-side step count)
        h.update(repr(torch.stack([s if s.device == dev else s.to(dev) for s in sums]).cpu().tolist()).encode())
    return h.hexdigest()


def _bit_sum(flat: torch.Tensor) -> torch.Tensor:
    """The wrapping 64-bit sum of ``flat``'s bits: its whole 64-bit words of consecutive
    elements read as int64 (no widening copy: a flipped bit still moves the sum by
    2**b), plus the remaining elements as integers of their own width. A tensor whose
    memory does not start on an 8-byte boundary is copied first (the words are the
    same; the narrow-integer sum torch runs otherwise is some hundred times slower)."""
    import torch

    if not flat.numel():
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    es = flat.element_size()
    per = 8 // es if es < 8 else 1
    whole = (flat.numel() // per) * per
    total: torch.Tensor | None = None
    if whole:
        body = flat[:whole] if whole < flat.numel() else flat
        if not body.is_contiguous() or (body.storage_offset() * es) % 8:
            body = body.contiguous() if not body.is_contiguous() else body.clone()
        total = body.view(torch.int64).sum()
    if whole == flat.numel():
        return total
    rest = flat[whole:]
    if rest.dtype.is_floating_point or rest.dtype.is_complex or rest.dtype == torch.bool:
        rest = rest.view(getattr(torch, _INT_OF_SIZE[es]))
    tail = rest.to(torch.int64).sum()
    return tail if total is None else total + tail


def same_layout_replicas(plan: ParallelPlan, replica: int, stage: int) -> int:
    """How many replicas hold ``stage`` with the TP degree ``replica`` has there (this
    one included): the devices a fingerprint can be compared with, plus one."""
    k = plan.degree(replica, stage)
    return sum(1 for q in range(plan.dp) if plan.group(q, stage) and plan.degree(q, stage) == k)


def grad_norm(grads: Iterable[torch.Tensor | None]) -> float:
    """The L2 norm of ``grads`` (None entries skipped), in float64 on the host: a
    device's range signal for its local reduced gradient (:class:`RangeWatch`). One
    foreach norm over the tensors, one device-to-host copy."""
    import torch

    gs = [g.detach() for g in grads if g is not None and g.numel()]
    if not gs:
        return 0.0
    norms = torch._foreach_norm(gs)
    return float(torch.linalg.vector_norm(torch.stack([n.to(torch.float64) for n in norms])))


class RangeWatch:
    """A device's recent committed range signals, and the judgement of a new one.

    A value is out of range when it is not finite, or when it is more than ``factor``
    times the largest of the last ``window`` committed values *and* more than
    ``sigmas`` robust standard deviations (1.4826 x the median absolute deviation) above
    their median, both on a log scale, once ``warmup`` values are known. Only increases
    count: the corruption this finds is a flipped exponent bit, which multiplies an
    element by 2**(2**k); a quantity that shrinks (a loss going down) is training. A
    signal at or below zero is judged for finiteness only."""

    def __init__(self, *, window: int = 64, warmup: int = 4, factor: float = 100.0, sigmas: float = 8.0) -> None:
        if warmup < 2 or window < warmup or factor <= 1.0 or sigmas <= 0.0:
            raise ValueError(f"RangeWatch: need 2 <= warmup <= window, factor > 1, sigmas > 0 (got window={window}, "
                             f"warmup={warmup}, factor={factor}, sigmas={sigmas})")
        self.window, self.warmup, self.factor, self.sigmas = window, warmup, factor, sigmas
        self._seen: dict[str, deque[float]] = {}

    def judge(self, signals: Mapping[str, float]) -> str:
        """Why one of ``signals`` is out of range ("" if none is)."""
        out = []
        for name, x in sorted(signals.items()):
            if not math.isfinite(x):
                out.append(f"{name} {x} is not finite")
                continue
            seen = self._seen.get(name)
            if x <= 0.0 or seen is None or len(seen) < self.warmup:
                continue
            logs = [math.log(v) for v in seen]
            med = statistics.median(logs)
            sigma = 1.4826 * statistics.median(abs(v - med) for v in logs)
            lx = math.log(x)
            if lx > max(logs) + math.log(self.factor) and lx > med + self.sigmas * sigma:
                out.append(f"{name} {x:.4g} is {x / max(seen):.3g}x the largest of the last {len(seen)} committed "
                           f"(median {math.exp(med):.4g})")
        return "; ".join(out)

    def commit(self, signals: Mapping[str, float]) -> None:
        """Take the signals of a committed iteration into the history (finite, positive
        ones only)."""
        for name, x in signals.items():
            if math.isfinite(x) and x > 0.0:
                self._seen.setdefault(name, deque(maxlen=self.window)).append(x)


def enabled(capable: bool, env: Mapping[str, str] | None = None) -> bool:
    """Whether a worker posts fingerprints: its adapter declares ``sdc_fingerprint`` and
    ``RESIHP_SDC`` is not ``0``."""
    env = os.environ if env is None else env
    return capable and env.get(ENV_SDC, "1") != "0"


# ------------------------------------------------------------------ comparing
@dataclass(frozen=True)
class SdcFinding:
    """Replicas that disagreed in ``iteration`` of ``generation``.

    :param suspects: devices outvoted by a strict majority of their group (decided).
    :param candidates: devices of groups with no majority (two replicas, or a tie):
        one of them is wrong, the comparison cannot say which.
    :param groups: each disagreeing group's digests by device (evidence).
    :param source: who found it (``fingerprint`` or a plugin detector's name).
    """

    generation: int
    iteration: int
    suspects: tuple[int, ...] = ()
    candidates: tuple[int, ...] = ()
    groups: dict[str, dict[int, str]] = field(default_factory=dict)
    source: str = "fingerprint"
    evidence: str = ""

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "iteration": self.iteration,
                           "suspects": list(self.suspects), "candidates": list(self.candidates),
                           "groups": {g: {str(d): v for d, v in m.items()} for g, m in self.groups.items()},
                           "source": self.source, "evidence": self.evidence})

    @classmethod
    def from_json(cls, text: str | bytes) -> SdcFinding:
        d = json.loads(text)
        return cls(int(d["generation"]), int(d["iteration"]), tuple(int(x) for x in d["suspects"]),
                   tuple(int(x) for x in d["candidates"]),
                   {g: {int(k): str(v) for k, v in m.items()} for g, m in d["groups"].items()},
                   str(d.get("source", "fingerprint")), str(d.get("evidence", "")))


def compare(fingerprints: Mapping[int, Fingerprint], *, generation: int, iteration: int) -> SdcFinding | None:
    """The disagreement among ``fingerprints`` (device -> its fingerprint), None if
    every group agrees. In a group of three or more, devices whose digest differs from
    the one a strict majority holds are suspects; a group without such a majority
    yields candidates only."""
    groups: dict[str, dict[int, str]] = {}
    for d, fp in fingerprints.items():
        if fp.group:  # "": a device no replica shares state with (signals only)
            groups.setdefault(fp.group, {})[d] = fp.digest
    suspects: set[int] = set()
    candidates: set[int] = set()
    bad: dict[str, dict[int, str]] = {}
    notes: list[str] = []
    for g, members in sorted(groups.items()):
        if len(set(members.values())) <= 1:
            continue
        bad[g] = dict(sorted(members.items()))
        digest, n = Counter(members.values()).most_common(1)[0]
        if 2 * n > len(members):
            odd = sorted(d for d, v in members.items() if v != digest)
            suspects.update(odd)
            notes.append(f"{g}: devices {odd} differ from the {n} of {len(members)} replicas that agree")
        else:
            candidates.update(members)
            notes.append(f"{g}: replicas {sorted(members)} disagree with no majority")
    if bad:
        return SdcFinding(generation, iteration, tuple(sorted(suspects)), tuple(sorted(candidates - suspects)), bad,
                          "fingerprint", f"iteration {iteration}: state fingerprints after the optimizer step "
                                         f"disagree: {'; '.join(notes)}")
    return out_of_range(fingerprints, generation=generation, iteration=iteration)


def out_of_range(fingerprints: Mapping[int, Fingerprint], *, generation: int, iteration: int) -> SdcFinding | None:
    """A ``range`` finding when the devices whose signals are out of range are one
    device or fewer than half of those reporting signals: a fault of their own. When
    more are out of range together the cause is shared (the data, or corruption before
    the reduction that reached every device alike): it is logged, not a finding."""
    reporting = [d for d, fp in fingerprints.items() if fp.signals]
    flagged = sorted(d for d, fp in fingerprints.items() if fp.anomaly)
    if not flagged:
        return None
    if len(flagged) > 1 and 2 * len(flagged) >= len(reporting):
        print(f"time={time.time():.3f} event=sdc_range_shared generation={generation} iteration={iteration} "
              f"devices={flagged} of={len(reporting)}", flush=True)
        return None
    notes = "; ".join(f"device {d}: {fingerprints[d].anomaly}" for d in flagged)
    return SdcFinding(generation, iteration, (), tuple(flagged), {}, "range",
                      f"iteration {iteration}: out of range against the device's recent iterations: {notes}")


def commit_check(store: KeyValueStore, generation: int, iteration: int, devices: Sequence[int]) -> Callable[[], bool]:
    """The check the executor completing ``iteration``'s commit count runs before it
    writes the verdict (:func:`resihp_core.runtime.session.commit`): True to commit;
    False after writing the :class:`SdcFinding` (the verdict is then ``abort``). A
    device that posted no fingerprint is not compared."""

    def check() -> bool:
        posted = session.get_fingerprints(store, generation, iteration, devices)
        try:
            fps = {d: Fingerprint.from_json(t) for d, t in posted.items()}
        except (ValueError, KeyError, TypeError) as e:  # not a fingerprint: say so, do not guess
            print(f"time={time.time():.3f} event=sdc_check_skipped generation={generation} iteration={iteration} "
                  f"reason={e!r:.200}", flush=True)
            return True
        finding = compare(fps, generation=generation, iteration=iteration)
        if finding is None:
            return True
        session.put_sdc_finding(store, generation, iteration, finding.to_json())
        print(f"time={time.time():.3f} event=sdc_detected generation={generation} iteration={iteration} "
              f"suspects={list(finding.suspects)} candidates={list(finding.candidates)}", flush=True)
        return False

    return check


@runtime_checkable
class _Fingerprinting(Protocol):
    def fingerprint(self) -> Fingerprint | None: ...


@runtime_checkable
class SnapshotFingerprint(Protocol):
    """An adapter that takes the next iteration's rollback snapshot right after its
    optimizer step and reads its fingerprint of that state during the copy
    (torch_native; docs/sdc.md "What it costs"). The worker then takes no snapshot at
    the next iteration's start."""

    def snapshot_fingerprint(self) -> Fingerprint | None: ...


class SdcGuard:
    """A worker's side: post this device's fingerprint of an iteration, and give the
    commit its check. Built by :meth:`for_adapter` (None when the adapter does not
    declare ``sdc_fingerprint`` or ``RESIHP_SDC=0``)."""

    def __init__(self, adapter: _Fingerprinting, device: int, watch: RangeWatch | None = None) -> None:
        self.adapter, self.device = adapter, device
        self.watch = watch or RangeWatch()
        self._pending: tuple[int, dict[str, float]] | None = None  # signals posted, verdict unknown
        self._plan: ParallelPlan | None = None
        self._layout = ""

    @classmethod
    def for_adapter(cls, adapter: object, device: int, env: Mapping[str, str] | None = None) -> SdcGuard | None:
        caps = getattr(adapter, "capabilities", None)
        if not enabled(bool(getattr(caps, "sdc_fingerprint", False)), env):
            return None
        if not isinstance(adapter, _Fingerprinting):
            raise TypeError(f"adapter {getattr(adapter, 'name', type(adapter).__name__)!r} declares sdc_fingerprint "
                            "but has no fingerprint() method")
        return cls(adapter, device)

    def prepare(self, iteration: int, loss: float = 0.0, plan: ParallelPlan | None = None,
                taken: tuple[Fingerprint | None] | None = None) -> str | None:
        """This device's fingerprint and range signals of ``iteration``, to be posted
        before its commit. The signals of the iteration posted before are taken as
        committed once a later iteration runs (an aborted one is run again under the
        same number). A new layout (``plan`` other than the last one's, the generation
        aside) restarts the history: what a device holds, and so its gradient's norm,
        changed with it.
        ``taken``: the fingerprint already taken with the rollback snapshot
        (:class:`SnapshotFingerprint`), in a 1-tuple (its None: no replica shares this
        shard); otherwise the adapter's :meth:`fingerprint` is called. Returns the text
        to post before the iteration's commit (None: nothing to post); the worker sends
        it with its commit, which sets it in the same store request as the report,
        before the add (:func:`resihp_core.runtime.session.commit_batch`)."""
        if self._pending is not None and self._pending[0] < iteration:
            self.watch.commit(self._pending[1])
        if plan is not None and plan is not self._plan:
            self._plan = plan
            layout = plan.to_text().split("\n", 2)[2]  # all but the header and the generation
            if layout != self._layout:
                self._layout, self.watch = layout, RangeWatch(window=self.watch.window, warmup=self.watch.warmup,
                                                              factor=self.watch.factor, sigmas=self.watch.sigmas)
                self._pending = None
        signals = dict(getattr(self.adapter, "sdc_signals", dict)())
        if loss:  # the last stage's share of the loss (0: a stage that computes none)
            signals["loss"] = float(loss)
        self._pending = (iteration, signals)
        fp = taken[0] if taken is not None else self.adapter.fingerprint()
        if fp is None and not signals:  # a device holding nothing a replica shares
            return None
        anomaly = self.watch.judge(signals)
        return Fingerprint(fp.group if fp else "", fp.digest if fp else "", signals, anomaly).to_json()

    def check(self, store: KeyValueStore, generation: int, iteration: int,
              devices: Sequence[int]) -> Callable[[], bool]:
        return commit_check(store, generation, iteration, devices)


# ------------------------------------------------------------------ plugin detectors
@dataclass(frozen=True)
class SdcView:
    """What a registered SDC detector is shown each time the controller looks: the
    current generation, its plan and the number of committed iterations."""

    generation: int
    committed: int
    plan: ParallelPlan | None
    devices: tuple[int, ...]


@dataclass(frozen=True)
class SdcSuspect:
    """A detector's verdict: ``device`` computed wrong numbers around ``iteration``."""

    device: int
    iteration: int
    evidence: str = ""


class SdcDetector(Protocol):
    """A detector registered with ``resihp_register_sdc_detectors`` (hardware error
    counters, a vendor health check). ``poll`` is called on the controller each time it
    looks (about ten times a second); it returns the devices it blames, each once."""

    def poll(self, view: SdcView) -> Iterable[SdcSuspect]: ...


# ------------------------------------------------------------------ the controller's side
@dataclass(frozen=True)
class SdcDetected:
    """Supervisor event: a finding of silent data corruption."""

    finding: SdcFinding


@dataclass(frozen=True)
class Quarantine:
    report: FailureReport


@dataclass(frozen=True)
class Reexecute:
    candidates: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Refuse:
    text: str


SdcDecision = Union[Quarantine, Reexecute, Refuse]


class SdcArbiter:
    """Decides what a finding means (pure; the supervisor owns it). An iteration with
    candidates but no suspects is re-executed once; a second finding for the same
    iteration is persistent corruption the arbiter cannot localise, except for a
    ``range`` finding: a device out of range in both runs is quarantined."""

    def __init__(self) -> None:
        self._reexecuted: dict[int, SdcFinding] = {}

    def decide(self, f: SdcFinding) -> SdcDecision:
        if f.suspects:
            return Quarantine(FailureReport(generation=f.generation, failure="fail-stop", devices=f.suspects,
                                            cause="sdc", evidence=f"silent data corruption ({f.source}): "
                                                                  f"{f.evidence}"[:500]))
        before = self._reexecuted.get(f.iteration)
        if before is None:
            self._reexecuted[f.iteration] = f
            why = (f"devices {list(f.candidates)} out of range" if f.source == "range"
                   else f"no majority among devices {list(f.candidates)}")
            return Reexecute(f.candidates, f"silent data corruption suspected at iteration {f.iteration} "
                                           f"({f.evidence[:200]}); {why}: re-executing the iteration to tell a "
                                           "transient fault from a persistent one")
        again = sorted(set(before.candidates) & set(f.candidates))
        if f.source == before.source == "range" and again:
            del self._reexecuted[f.iteration]  # decided: its commit on the survivors is no transient
            return Quarantine(FailureReport(
                generation=f.generation, failure="fail-stop", devices=tuple(again), cause="sdc",
                evidence=f"silent data corruption (range): out of range again on re-execution: {f.evidence}"[:500]))
        both = sorted(set(before.candidates) | set(f.candidates))
        return Refuse(f"silent data corruption at iteration {f.iteration} persisted on re-execution among "
                      f"devices {both} ({f.evidence[:200]}); with no majority of replicas ResiHP cannot tell "
                      "which device is wrong and refuses to guess: take one of them out (or repair it) and "
                      "resume the job from a checkpoint")

    def committed(self, iteration: int) -> str | None:
        """Text for an event when a re-executed iteration commits (a transient fault)."""
        f = self._reexecuted.pop(iteration, None)
        if f is None:
            return None
        return (f"iteration {iteration} re-executed after replicas {list(f.candidates)} disagreed: the "
                "re-execution agreed and committed (a transient fault); nothing quarantined")


class SdcMonitor:
    """The control loop's reader of SDC findings: the fingerprint check's (written by
    the worker that aborted an iteration) and those of registered detectors."""

    def __init__(self, detectors: Mapping[str, SdcDetector] | None = None, *, every_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.detectors = dict(detectors or {})
        self.every_s, self.clock = every_s, clock
        self._last = float("-inf")
        self._seen: set[tuple[int, int]] = set()
        self._blamed: set[tuple[str, int, int]] = set()

    @classmethod
    def from_plugins(cls) -> SdcMonitor:
        """With every detector registered through ``resihp_register_sdc_detectors``
        (none loaded if the plugins cannot be read: the fingerprints still work)."""
        try:
            from resihp_core.plugins import Plugins

            reg = Plugins().sdc_detectors()
            return cls({name: reg.create(name) for name in reg.names()})
        except Exception as e:  # noqa: BLE001 - a broken plugin must not stop the job
            logger.warning("SDC detectors from plugins not loaded: %s", e)
            return cls()

    def poll(self, job: JobSession) -> list[SdcDetected]:
        now = self.clock()
        if now - self._last < self.every_s:
            return []
        self._last = now
        out: list[SdcDetected] = []
        g, i = job.generation, job.committed
        if (g, i) not in self._seen and session.verdict(job.store, g, i) == session.CommitResult.ABORTED:
            text = session.get_sdc_finding(job.store, g, i)
            if text is not None:
                self._seen.add((g, i))
                out.append(SdcDetected(SdcFinding.from_json(text)))
        if self.detectors:
            msg = job.message
            view = SdcView(g, i, job.plan, tuple(msg.devices) if msg is not None else ())
            for name, det in self.detectors.items():
                try:
                    got = list(det.poll(view))
                except Exception as e:  # noqa: BLE001 - a plugin's failure is logged, not the job's
                    logger.warning("SDC detector %s failed: %s", name, e)
                    continue
                for s in got:
                    if (name, s.device, s.iteration) in self._blamed:
                        continue
                    self._blamed.add((name, s.device, s.iteration))
                    out.append(SdcDetected(SdcFinding(g, s.iteration, (s.device,), source=name,
                                                      evidence=s.evidence or f"reported by {name}")))
        return out
