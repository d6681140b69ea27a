"""Pipeline schedule emission: GPipe, 1F1B (PipeDream-flush) and ZB-H1.

One source of truth: :func:`compute_orders` decides, per executor (replica, stage), the
order of its F/B/W compute over the work the plan assigns it. :func:`emit_programs`
wraps that order with the loads, receives and sends each compute needs, and the
simulator (:mod:`.simulator`) simulates the same order — so what the workers run is
exactly what the planner judged.

Without migrated work every executor follows its stage's fixed template
(:func:`stage_order`). With migrated work a fixed "local first" or even a key-sorted
1F1B order can deadlock (replicas exchanging work wait on each other), so orders come
from :func:`dynamic_orders`: every executor takes its work in one global key order
(mb, owner), runs a forward while it is under the schedule's in-flight cap, otherwise
a backward, in lock-step rounds. Any wait then points at a strictly smaller key or
further along the pipeline, so no cycle can form; on plans without migrations the same
policy reproduces the templates exactly (tested).

Compute kinds are small ints: ``F`` (forward), ``B`` (backward; input-gradient only
under ZB-H1), ``W`` (weight gradient, ZB-H1 only).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

from resihp_core.plan import ParallelPlan, ScheduleKind
from resihp_core.program import (
    Backward,
    BackwardWeight,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    Primitive,
    Program,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)

__all__ = ["F", "B", "W", "KIND_NAMES", "stage_order", "compute_orders", "emit_programs", "program_order"]

F, B, W = 0, 1, 2
KIND_NAMES = "FBW"


@lru_cache(maxsize=4096)
def stage_order(kind: ScheduleKind, n_work: int, stage: int, pp: int) -> tuple[tuple[int, int], ...]:
    """(compute kind, work index) sequence for one executor holding ``n_work`` items.

    1F1B: ``min(n_work, pp - stage)`` warm-up forwards, then alternate B/F, then the
    remaining backwards — the order of DeepSpeed's ``TrainSchedule`` and torch's
    ``Schedule1F1B``. ZB-H1: the same F/B order with B split into B (input gradient)
    and W (weight gradient); stage s keeps up to ``s`` W passes pending, running the
    oldest right after a B once more are pending, and the rest at the end. Later stages
    thus defer more W into the cool-down, so B reaches earlier stages sooner; every
    stage holds at most ``pp`` micro-batches' activations (1F1B's memory), and for
    m >= p homogeneous stages the bubble is exactly (p-1)(F+B-W) (tested).
    """
    kind = ScheduleKind(kind)
    if n_work == 0:
        return ()
    if kind is ScheduleKind.GPIPE:
        return tuple((F, i) for i in range(n_work)) + tuple((B, i) for i in range(n_work))
    warmup = min(n_work, pp - stage)
    out: list[tuple[int, int]] = [(F, i) for i in range(warmup)]
    zb = kind is ScheduleKind.ZB_H1
    pending: list[int] = []
    nf = warmup
    for nb in range(n_work):
        out.append((B, nb))
        if zb:
            pending.append(nb)
            if len(pending) > stage:
                out.append((W, pending.pop(0)))
        if nf < n_work:
            out.append((F, nf))
            nf += 1
    out.extend((W, i) for i in pending)
    return tuple(out)


def compute_orders(plan: ParallelPlan) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """(replica, stage) -> ordered (kind, owner replica, mb) compute for every executor."""
    if plan.migrations:
        return dynamic_orders(plan)
    out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r, s in plan.executors():
        work = plan.work(r, s)
        out[(r, s)] = [
            (k, *work[i]) for k, i in stage_order(plan.schedule, len(work), s, plan.pp)
        ]
    return out


def _caps(kind: ScheduleKind, stage: int, pp: int, n: int) -> tuple[int, int]:
    """(max forwards awaiting B, max forwards awaiting W) for one executor."""
    if kind is ScheduleKind.GPIPE:
        return n, n
    if kind is ScheduleKind.ZB_H1:
        return pp - stage, pp
    return pp - stage, pp - stage


@lru_cache(maxsize=8)  # a 16k-device plan's orders are ~19 MB
def dynamic_orders(plan: ParallelPlan) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """Deadlock-free orders for any plan (see the module docstring), computed in
    lock-step rounds vectorised over executors. Each round an executor runs one chunk:
    an over-due W (ZB-H1 keeps at most ``stage`` pending), else a forward if under the
    in-flight cap and its input is computed, else a backward if its gradient is
    computed, else (once all its forwards are issued) a pending W."""
    pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
    zb = plan.schedule is ScheduleKind.ZB_H1
    execs = list(plan.executors())
    works = [plan.work(r, s) for r, s in execs]
    ne = len(execs)
    n = np.array([len(w) for w in works], dtype=np.int64)
    width = int(n.max(initial=0)) + 1
    stage = np.array([s for _, s in execs], dtype=np.int64)
    # Vertex ids as in the simulator: ((kind * pp + stage) * dp + owner) * m + mb.
    base = np.full((ne, width), -1, dtype=np.int64)
    for e, ((r, s), w) in enumerate(zip(execs, works)):
        if w:
            base[e, : len(w)] = [(s * dp + o) * m + j for o, j in w]
    nv = 3 * pp * dp * m
    shift = pp * dp * m
    fv, bv, wv = base, np.where(base >= 0, base + shift, -1), np.where(base >= 0, base + 2 * shift, -1)
    # Data predecessor of every vertex (nv = none); F of stage s needs F of s-1, B of s
    # needs B of s+1 (the last stage: its own F), W needs B.
    ids = np.arange(nv, dtype=np.int64).reshape(3, pp, dp, m)
    pred = np.full((3, pp, dp, m), nv, dtype=np.int64)
    pred[F, 1:] = ids[F, :-1]
    pred[B, :-1] = ids[B, 1:]
    pred[B, -1] = ids[F, -1]
    pred[W] = ids[B]
    pred = np.append(pred.ravel(), nv)
    done = np.zeros(nv + 1, dtype=bool)
    done[nv] = True
    caps = np.array([_caps(plan.schedule, s, pp, len(w)) for (_, s), w in zip(execs, works)], dtype=np.int64).reshape(ne, 2)
    fp = np.zeros(ne, dtype=np.int64)
    bp = np.zeros(ne, dtype=np.int64)
    wp = np.zeros(ne, dtype=np.int64)
    total = n * (3 if zb else 2)
    out = np.full((ne, int(total.max(initial=0))), -1, dtype=np.int64)
    olen = np.zeros(ne, dtype=np.int64)
    rows = np.arange(ne)
    while True:
        live = olen < total
        if not live.any():
            break
        vf, vb, vw = fv[rows, fp], bv[rows, bp], wv[rows, wp]
        w_due = zb & (wp < bp) & (bp - wp > stage) if zb else np.zeros(ne, bool)
        f_ok = (fp < n) & (fp - bp < caps[:, 0]) & (fp - wp < caps[:, 1]) & done[pred[vf]] if zb else (
            (fp < n) & (fp - bp < caps[:, 0]) & done[pred[vf]])
        b_ok = (bp < fp) & done[pred[vb]]
        w_ok = (wp < bp) & (fp == n) if zb else np.zeros(ne, bool)
        pick_w = live & w_due
        pick_f = live & ~pick_w & f_ok
        pick_b = live & ~pick_w & ~pick_f & b_ok
        pick_w |= live & ~pick_f & ~pick_b & w_ok
        chosen = np.where(pick_w, vw, np.where(pick_f, vf, np.where(pick_b, vb, -1)))
        moved = chosen >= 0
        if not moved.any():
            e = int(np.nonzero(live)[0][0])
            raise RuntimeError(f"dynamic_orders stalled at executor {execs[e]} (bug)")
        out[moved, olen[moved]] = chosen[moved]
        olen += moved
        done[chosen[moved]] = True
        fp += pick_f
        bp += pick_b
        wp += pick_w
    result: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for e, key in enumerate(execs):
        k, rest = np.divmod(out[e, : olen[e]], shift)
        _, rest = np.divmod(rest, dp * m)
        o, j = np.divmod(rest, m)
        result[key] = list(zip(k.tolist(), o.tolist(), j.tolist()))
    return result


def emit_programs(plan: ParallelPlan) -> list[Program]:
    """Per-executor programs: each compute preceded by the receive it needs and followed
    by the send it feeds, then the DP gradient reduction and the optimizer step."""
    last = plan.pp - 1
    split = plan.schedule is ScheduleKind.ZB_H1
    programs = []
    for (r, s), order in compute_orders(plan).items():
        ops: list[Primitive] = []
        for k, o, j in order:
            if k == F:
                if s == 0 or s == last:
                    ops.append(LoadMicroBatch(o, j))
                if s > 0:
                    ops.append(RecvActivation(s, o, j, plan.executor(s - 1, o, j)))
                ops.append(Forward(s, o, j))
                if s < last:
                    ops.append(SendActivation(s, o, j, plan.executor(s + 1, o, j)))
            elif k == B:
                if s < last:
                    ops.append(RecvGrad(s, o, j, plan.executor(s + 1, o, j)))
                ops.append(Backward(s, o, j, split))
                if s > 0:
                    ops.append(SendGrad(s, o, j, plan.executor(s - 1, o, j)))
            else:
                ops.append(BackwardWeight(s, o, j))
        ops += [ReduceGrads(s), OptimizerStep(s)]
        programs.append(Program(r, s, plan.generation, tuple(ops)))
    return programs


def program_order(program: Program) -> list[tuple[int, int, int]]:
    """The (kind, owner, mb) compute order of a program — the inverse of emission."""
    out = []
    for op in program.ops:
        if isinstance(op, Forward):
            out.append((F, op.owner, op.mb))
        elif isinstance(op, Backward):
            out.append((B, op.owner, op.mb))
        elif isinstance(op, BackwardWeight):
            out.append((W, op.owner, op.mb))
    return out


def orders_from_programs(programs: Sequence[Program]) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    return {(p.replica, p.stage): program_order(p) for p in programs}
