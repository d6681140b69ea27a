"""The pipeline DAG simulator (docs/design.md §3.4): iteration time of a plan for a workload.

Vertices are the F/B/W compute chunks of every (stage, micro-batch). Each has at most
two predecessors: the previous compute on the same executor (resource edge, in the
order :mod:`.schedules` emits) and one data predecessor (F of stage s-1; B of stage s+1,
or the last stage's own F; the B before a W), with a communication time on data edges.
A vertex starts at the max over its predecessors of (finish + edge time). The
iteration ends when, for every stage, the DP gradient reduction after its last chunk
and the optimizer step are done.

Speed: vertices are processed in *rounds*, one per executor per round, vectorised with
numpy across executors; the number of rounds is about the unit-time makespan
(~2·(m + p)), not the number of vertices, so a 16k-device plan takes milliseconds to
hundreds of milliseconds instead of seconds.

Arrays are indexed ``[kind, stage, owner replica, mb]`` with kind 0/1/2 = F/B/W.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np

from resihp_core.plan import ParallelPlan, ScheduleKind
from resihp_core.predictor.schedules import B, F, KIND_NAMES, W, dynamic_orders, stage_order

__all__ = ["SimulationError", "SimResult", "simulate", "order_matrix"]


class SimulationError(RuntimeError):
    """The orders cannot run to completion (a dependency cycle), or inputs are malformed."""


@dataclass(frozen=True)
class SimResult:
    """Simulated timeline of one iteration (seconds)."""

    start: np.ndarray  # [3, pp, dp, m], NaN where a vertex does not exist (W without split)
    finish: np.ndarray
    stage_done: np.ndarray  # [pp]: last compute of the stage over all replicas
    iteration_time: float  # max over stages of stage_done + reduce + optimizer
    pipeline_time: float  # critical path length of the compute DAG
    critical_path: tuple[tuple[str, int, int, int], ...]  # (kind, stage, owner, mb), in time order
    executors: tuple[tuple[int, int], ...]  # (replica, stage) row order of the order matrix
    busy: np.ndarray  # [len(executors)]: compute seconds per executor
    executed_on: np.ndarray  # [pp, dp, m]: replica executing stage s of micro-batch (r, j)

    def progress(self, t: float) -> np.ndarray:
        """Forward passes completed by time ``t`` per [stage, executing replica] (local
        plus migrated-in) — the progress count of the migration heuristic (docs/design.md §4.3)."""
        pp, dp, _ = self.executed_on.shape
        out = np.zeros((pp, dp), dtype=np.int64)
        done = self.finish[F] <= t
        for s in range(pp):
            np.add.at(out[s], self.executed_on[s][done[s]], 1)
        return out


def _vid(k: int, s: int, r: int, j: int, pp: int, dp: int, m: int) -> int:
    return ((k * pp + s) * dp + r) * m + j


def order_matrix(
    plan: ParallelPlan,
    orders: Mapping[tuple[int, int], Sequence[tuple[int, int, int]]] | None = None,
) -> tuple[tuple[tuple[int, int], ...], np.ndarray, np.ndarray]:
    """Executors, their compute orders as vertex ids (padded with -1), and lengths.

    Without ``orders`` the matrix is built from the emitter's per-stage templates
    directly (fast path, cached per plan); with ``orders`` (e.g. read back from programs) it is built
    from them, so tests can prove both are the same."""
    if orders is None:
        return _default_order_matrix(plan)
    return _order_matrix(plan, orders)


@lru_cache(maxsize=32)
def _default_order_matrix(plan: ParallelPlan) -> tuple[tuple[tuple[int, int], ...], np.ndarray, np.ndarray]:
    execs, mat, lengths = _order_matrix(plan, None)
    mat.flags.writeable = False
    lengths.flags.writeable = False
    return execs, mat, lengths


def _order_matrix(
    plan: ParallelPlan,
    orders: Mapping[tuple[int, int], Sequence[tuple[int, int, int]]] | None,
) -> tuple[tuple[tuple[int, int], ...], np.ndarray, np.ndarray]:
    pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
    if orders is None and plan.migrations:
        orders = dynamic_orders(plan)
    execs = tuple(plan.executors())
    moved_out, moved_in = plan._moves_by_executor
    arange_m = np.arange(m, dtype=np.int64)
    rows: list[np.ndarray] = []
    for r, s in execs:
        if orders is not None:
            seq = orders[(r, s)]
            kom = np.asarray(seq, dtype=np.int64).reshape(-1, 3)  # (kind, owner, mb) rows
            row = ((kom[:, 0] * pp + s) * dp + kom[:, 1]) * m + kom[:, 2]  # _vid, vectorised
        else:
            if (r, s) in moved_out or (r, s) in moved_in:
                work = plan.work(r, s)
                owners = np.fromiter((o for o, _ in work), np.int64, len(work))
                mbs = np.fromiter((j for _, j in work), np.int64, len(work))
            else:
                owners, mbs = np.full(m, r, np.int64), arange_m
            if not len(mbs):
                rows.append(np.empty(0, np.int64))
                continue
            kinds, idx = _template(plan.schedule, len(mbs), s, pp)
            row = ((kinds * pp + s) * dp + owners[idx]) * m + mbs[idx]
        rows.append(row)
    lengths = np.array([len(x) for x in rows], dtype=np.int64)
    mat = np.full((len(rows), int(lengths.max(initial=0))), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        mat[i, : len(row)] = row
    return execs, mat, lengths


_TEMPLATES: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def _template(kind: ScheduleKind, n: int, s: int, pp: int) -> tuple[np.ndarray, np.ndarray]:
    key = (kind, n, s, pp)
    t = _TEMPLATES.get(key)
    if t is None:
        seq = stage_order(kind, n, s, pp)
        t = (np.array([k for k, _ in seq], np.int64), np.array([i for _, i in seq], np.int64))
        if len(_TEMPLATES) > 4096:
            _TEMPLATES.clear()
        _TEMPLATES[key] = t
    return t


def simulate(
    plan: ParallelPlan,
    durations: np.ndarray,
    *,
    comm_forward: np.ndarray | float = 0.0,
    comm_backward: np.ndarray | float = 0.0,
    reduce_time: np.ndarray | float = 0.0,
    optimizer_time: np.ndarray | float = 0.0,
    orders: Mapping[tuple[int, int], Sequence[tuple[int, int, int]]] | None = None,
) -> SimResult:
    """Simulate one iteration of ``plan``.

    :param durations: ``[3, pp, dp, m]`` compute seconds of F/B/W of stage s of
        micro-batch (r, j) on the replica that executes it (W ignored unless ZB-H1).
    :param comm_forward: ``[pp, dp, m]`` seconds on the edge into F(s, r, j) from stage
        s-1 (row 0 unused), or a scalar for every such edge.
    :param comm_backward: ``[pp, dp, m]`` seconds on the edge into B(s, r, j) from stage
        s+1 (last row unused), or a scalar.
    :param reduce_time: ``[pp]`` DP gradient reduction per stage, or a scalar.
    :param optimizer_time: ``[pp]`` optimizer step per stage, or a scalar.
    :param orders: compute orders per executor; default: the emitter's.
    """
    pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
    shape = (3, pp, dp, m)
    dur = np.asarray(durations, dtype=np.float64)
    if dur.shape != shape:
        raise SimulationError(f"durations must have shape {shape}, got {dur.shape}")
    if not np.isfinite(dur).all() or (dur < 0).any():
        raise SimulationError("durations must be finite and >= 0")
    cf = np.broadcast_to(np.asarray(comm_forward, np.float64), (pp, dp, m))
    cb = np.broadcast_to(np.asarray(comm_backward, np.float64), (pp, dp, m))
    red = np.broadcast_to(np.asarray(reduce_time, np.float64), (pp,))
    opt = np.broadcast_to(np.asarray(optimizer_time, np.float64), (pp,))

    nv = 3 * pp * dp * m
    # Data predecessor and edge time of every vertex; index nv is a sentinel "done at 0".
    ids = np.arange(nv, dtype=np.int64).reshape(shape)
    pred = np.full(shape, nv, dtype=np.int64)
    comm = np.zeros(shape)
    pred[F, 1:] = ids[F, :-1]
    comm[F, 1:] = cf[1:]
    pred[B, :-1] = ids[B, 1:]
    comm[B, :-1] = cb[:-1]
    pred[B, -1] = ids[F, -1]
    pred[W] = ids[B]
    pred = pred.ravel()
    comm = comm.ravel()
    dflat = dur.ravel()

    execs, mat, lengths = order_matrix(plan, orders)
    ne, width = mat.shape
    # Per order-matrix slot: vertex, data predecessor, edge time, duration (flat, so a
    # round does one gather per quantity). Padding slots are never reached.
    slot_v = mat.ravel()
    safe = np.where(slot_v >= 0, slot_v, 0)
    slot_pred = pred[safe]
    slot_comm = comm[safe]
    slot_dur = dflat[safe]
    fin = np.full(nv + 1, np.nan)
    fin[nv] = 0.0
    free = np.zeros(ne)
    pos = np.arange(ne, dtype=np.int64) * width  # next slot of each executor
    end = pos + lengths
    active = np.nonzero(lengths > 0)[0]
    while active.size:
        lin = pos[active]
        ready = fin[slot_pred[lin]] + slot_comm[lin]  # NaN while the predecessor has not run
        ok = ready == ready
        n_ok = np.count_nonzero(ok)
        partial = n_ok != len(ok)
        if partial:
            active, lin, ready = active[ok], lin[ok], ready[ok]
            if not active.size:
                e = execs[int(np.nonzero(pos < end)[0][0])]
                raise SimulationError(
                    f"orders deadlock: executor replica {e[0]} stage {e[1]} waits on a chunk "
                    "that can never run"
                )
        f = np.maximum(free[active], ready) + slot_dur[lin]
        fin[slot_v[lin]] = f
        free[active] = f
        lin += 1
        pos[active] = lin
        if partial or np.count_nonzero(lin == end[active]):
            active = np.nonzero(pos < end)[0]
    start = np.full(nv, np.nan)
    done = slot_v[slot_v >= 0]
    start[done] = fin[done] - dflat[done]
    ready_all = fin[pred[done]] + comm[done]
    data_bound = np.zeros(nv, dtype=bool)
    data_bound[done] = ready_all >= start[done] - 1e-12 * np.maximum(1.0, np.abs(start[done]))

    finish = fin[:nv]
    fin4 = finish.reshape(shape)
    stage_done = np.nan_to_num(np.nanmax(fin4.reshape(3, pp, -1).transpose(1, 0, 2).reshape(pp, -1), axis=1, initial=0.0))
    iteration = float(np.max(stage_done + red + opt))
    busy = np.where(mat >= 0, dflat[mat], 0.0).sum(axis=1)

    # Critical path: walk back from the last vertex along binding edges. A vertex not
    # bound by its data edge started when the previous compute on its executor ended.
    prev = np.full(nv, -1, dtype=np.int64)
    has_prev = mat[:, 1:] >= 0
    prev[mat[:, 1:][has_prev]] = mat[:, :-1][has_prev]
    path: list[tuple[str, int, int, int]] = []
    v = int(np.nanargmax(finish)) if lengths.sum() else -1
    pipeline_time = float(finish[v]) if v >= 0 else 0.0
    while v >= 0:
        k, s, r, j = np.unravel_index(v, shape)
        path.append((KIND_NAMES[k], int(s), int(r), int(j)))
        nxt = int(pred[v]) if data_bound[v] else int(prev[v])
        v = -1 if nxt == nv else nxt
    path.reverse()

    executed_on = np.broadcast_to(np.arange(dp)[None, :, None], (pp, dp, m)).copy()
    for mig in plan.migrations:
        executed_on[mig.stage, mig.replica, mig.mb] = mig.to
    return SimResult(
        start=start.reshape(shape),
        finish=fin4,
        stage_done=stage_done,
        iteration_time=iteration,
        pipeline_time=pipeline_time,
        critical_path=tuple(path),
        executors=execs,
        busy=busy,
        executed_on=executed_on,
    )


def _name(v: int, pp: int, dp: int, m: int) -> str:
    k, s, r, j = np.unravel_index(v, (3, pp, dp, m))
    return f"{KIND_NAMES[k]} of stage {s} micro-batch (replica {r}, mb {j})"
