"""False alarms of the fail-slow detector on a real corpus's length fluctuation.

The job of ``examples/configs/stdlib_text.toml`` trains on the Python standard
library's source files (one document per file, byte tokens, N-token micro-batches):
real, long-tailed document lengths, so a micro-batch of one long file costs several
times one packed with many short files (attention is per document, ~Σ l²).

Method (one process, trace-driven from real measurements):

1. **record** — for every micro-batch ``(iteration, replica, mb)`` of the job's data
   source, time the reference model's forward and backward of each pipeline stage of
   the job's plan (the stage split of ``resihp_adapters.megatron_ref``, the config's
   model sizes, one thread); the trace is timed in ``--repeats`` passes and each
   chunk's minimum kept. The clock is the thread's CPU time by default (``--clock cpu``): on a shared
   machine with a load average far above its cores, wall time mostly measures the
   other processes; ``--clock wall`` takes wall time (on a quiet machine);
2. **compose** — each replica's iteration is the 1F1B schedule over those chunk times,
   the iteration time the slowest replica's plus a fixed 2 ms DP all-reduce; every rank
   gets the :class:`~resihp_core.protocol.IterationProfile` a worker would send;
3. **detect** — the same profiles go to three detectors, built as ``resihp run``
   builds them (config ``[detector]``, the job's plan and planning predictor,
   ``resihp_core.runtime.controller.jobs.build_job``):
   ``resihp`` (workload-aware: BOCPD on measured / predicted-healthy, the predictor
   sees every micro-batch's document lengths), ``length-blind`` (the same detector fed
   profiles whose document lengths are hidden: every micro-batch looks like one
   N-token document, so it cannot tell a long-file micro-batch from a slow device),
   and ``greyhound`` (change points on the raw iteration time, each one verified).
   Every failure report on this fault-free trace is a false alarm; every verification
   costs training time.
4. **power check** — the same trace with one device's chunks ``--slow-factor`` times
   slower (default 1.54: docs/design.md's "weak" fail-slow) from ``--slow-at``: the detector
   must still report it.

    python benchmarks/data_detector.py [--quick] [--json PATH] [--iterations I]

Exits 1 if it could not measure (or the corpus could not be built).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters", ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from resihp_core.config import Config, load_config  # noqa: E402
from resihp_core.protocol import IterationProfile, MicroBatchProfile  # noqa: E402

CONFIG = ROOT / "examples" / "configs" / "stdlib_text.toml"
ALLREDUCE_S = 0.002
WEAK = 1.0 / (1.0 - 0.35)

Chunks = dict[tuple[int, int, int], tuple[float, float]]  # (replica, stage, mb) -> (fwd, bwd)


# ------------------------------------------------------------------ record
def worst_window(cfg: Config, width: int) -> int:
    """First iteration of the ``width``-iteration window whose second half has the most
    attention work over its first half (the slowest replica's Σ l² per iteration): the
    sharpest *rise* in cost the corpus has in this order. A rise is the hard case: the
    warm-up is fitted on cheap (many short documents) iterations, and the expensive ones
    that follow look like a slowdown to a detector blind to lengths. (A packed
    micro-batch costs at most one N-token document's attention, so most shifts of a
    real corpus go down, which no threshold mistakes for a slowdown.) Lengths only:
    cheap, no model."""
    from resihp_core.data import create_source

    tr, par = cfg.training, cfg.parallel
    src = create_source(cfg.data.section(), dp=par.dp, num_microbatches=tr.microbatches, seed=tr.seed,
                        token_budget=tr.token_budget, vocab_size=cfg.model.vocab)
    epoch = src.index.total // (tr.token_budget * par.dp * tr.microbatches)
    work = []
    for it in range(epoch):
        wl = src.workload(it)
        work.append(max(sum(sum(l * l for l in wl[(r, j)]) for j in range(tr.microbatches)) for r in range(par.dp)))
    half = width // 2
    best, start = -1.0, 0
    for a in range(0, max(1, epoch - width)):
        d = statistics.mean(work[a + half:a + width]) - statistics.mean(work[a:a + half])
        if d > best:
            best, start = d, a
    return start


def record(cfg: Config, iterations: int, repeats: int, clock: str = "cpu",
           start: int = 0) -> tuple[list[Chunks], list[dict], Any]:
    """Real chunk times of every micro-batch of ``iterations`` iterations, their
    document lengths, and the job (plan, state) built as ``resihp run`` builds it."""
    import tempfile

    import torch

    from resihp_core.runtime.controller.jobs import build_job
    from resihp_adapters.megatron_ref.adapter import data_spec, model_config
    from resihp_adapters.megatron_ref.data import micro_batch
    from resihp_adapters.megatron_ref.model import build_stage

    torch.set_num_threads(1)
    now = time.thread_time if clock == "cpu" else time.perf_counter
    job = build_job(cfg, [], Path(tempfile.mkdtemp(prefix="resihp-datadet-")))
    plan, state = job.plan, job.state
    data, model = data_spec(job.spec), model_config(job.spec)
    bounds, a = [], 0
    for s in range(plan.pp):
        bounds.append((a, a + plan.layers(s)))
        a += plan.layers(s)
    stages = [build_stage(model, bounds[s], s == 0, s == plan.pp - 1) for s in range(plan.pp)]
    denom = 1.0
    batches = [(it, r, j, micro_batch(data, it, r, j)) for it in range(start, start + iterations)
               for r in range(plan.dp) for j in range(plan.num_microbatches)]
    best: dict[tuple[int, int, int, int], list[float]] = {}
    # Passes over the whole trace, not back-to-back repeats: a burst of other work on a
    # shared machine then rarely hits the same chunk in every pass.
    for _ in range(repeats):
        for it, r, j, b in batches:
            x, ins, outs = b.tokens, [], []
            for s, st in enumerate(stages):
                t0 = now()
                y = st(x, b.lengths, b.labels) / denom if s == plan.pp - 1 else st(x, b.lengths)
                cell = best.setdefault((it, r, s, j), [float("inf"), float("inf")])
                cell[0] = min(cell[0], now() - t0)
                ins.append(x)
                outs.append(y)
                x = y.detach().requires_grad_()
            grad = None
            for s in reversed(range(plan.pp)):
                t0 = now()
                outs[s].backward(grad)
                cell = best[(it, r, s, j)]
                cell[1] = min(cell[1], now() - t0)
                grad = ins[s].grad if s > 0 else None
            for st in stages:
                for p in st.parameters():
                    p.grad = None
    traces: list[Chunks] = []
    lengths: list[dict] = []
    for it in range(start, start + iterations):
        traces.append({(r, s, j): (best[(it, r, s, j)][0], best[(it, r, s, j)][1])
                       for r in range(plan.dp) for s in range(plan.pp) for j in range(plan.num_microbatches)})
        lengths.append({(r, j): b.lengths for i, r, j, b in batches if i == it})
    return traces, lengths, (plan, state)


# ------------------------------------------------------------------ compose
def one_f_one_b(fwd: list[list[float]], bwd: list[list[float]]) -> float:
    """Makespan of one replica's 1F1B schedule (stage s: min(P-s-1, m) warm-up
    forwards, then forward/backward pairs, then the remaining backwards)."""
    pp, m = len(fwd), len(fwd[0])
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        ops = [("F", j) for j in range(warm)]
        f = b = 0
        f = warm
        while f < m:
            ops += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        ops += [("B", k) for k in range(b, m)]
        orders.append(ops)
    end: dict[tuple[str, int, int], float] = {}
    free, idx = [0.0] * pp, [0] * pp
    while any(idx[s] < len(orders[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while idx[s] < len(orders[s]):
                kind, j = orders[s][idx[s]]
                if kind == "F":
                    dep = end.get(("F", s - 1, j)) if s > 0 else 0.0
                else:
                    dep = end.get(("B", s + 1, j)) if s < pp - 1 else end.get(("F", s, j))
                if dep is None:
                    break
                t = (fwd if kind == "F" else bwd)[s][j]
                end[(kind, s, j)] = free[s] = max(free[s], dep) + t
                idx[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("1F1B order deadlocked")
    return max(free)


def profiles_of(it: int, chunks: Chunks, lens: dict, plan: Any, *, slow: dict[int, float] | None = None,
                hide_lengths: bool = False) -> dict[int, IterationProfile]:
    """The per-rank profiles of one iteration (``slow``: device -> chunk-time factor)."""
    slow = slow or {}
    pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
    factor = {(r, s): max((slow.get(d, 1.0) for d in plan.group(r, s)), default=1.0)
              for r in range(dp) for s in range(pp)}
    times = {k: (f * factor[(k[0], k[1])], b * factor[(k[0], k[1])]) for k, (f, b) in chunks.items()}
    total = max(one_f_one_b([[times[(r, s, j)][0] for j in range(m)] for s in range(pp)],
                            [[times[(r, s, j)][1] for j in range(m)] for s in range(pp)])
                for r in range(dp)) + ALLREDUCE_S
    n = sum(lens[(0, 0)])
    out = {}
    for r in range(dp):
        for s in range(pp):
            mbs = tuple(MicroBatchProfile(owner=r, mb=j, forward_s=times[(r, s, j)][0],
                                          backward_s=times[(r, s, j)][1],
                                          doc_lengths=(n,) if hide_lengths else tuple(lens[(r, j)]))
                        for j in range(m))
            comp = sum(x.forward_s + x.backward_s for x in mbs)
            for d in plan.group(r, s):
                out[d] = IterationProfile(rank=d, device=d, generation=0, iteration=it, stage=s, replica=r,
                                          microbatches=mbs, comm_s=max(0.0, total - comp), iteration_s=total)
    return out


# ------------------------------------------------------------------ detect
def detectors(cfg: Config, plan: Any, state: Any) -> dict[str, Any]:
    from resihp_core.detector.failslow import build_baseline_detector, build_failslow_detector
    from resihp_core.detector.model import WorkloadModel

    det = cfg.detector

    def resihp() -> Any:
        model = WorkloadModel(plan=plan, predictor=state.predictor, warmup_iterations=det.warmup_iterations)
        return build_failslow_detector(det, model=model, plan=plan)

    return {"resihp": resihp(), "length-blind": resihp(), "greyhound": build_baseline_detector(det)}


def replay(cfg: Config, traces: list[Chunks], lengths: list[dict], job: Any, *,
           slow_at: int | None = None, slow_device: int | None = None, factor: float = WEAK) -> dict[str, dict]:
    plan, state = job
    dets = detectors(cfg, plan, state)
    out = {name: {"reports": [], "verifications": 0, "change_points": 0, "benign": 0} for name in dets}
    for k, (chunks, lens) in enumerate(zip(traces, lengths)):
        it = k  # iterations renumbered from 0 (a window may start anywhere in the stream)
        slow = {slow_device: factor} if slow_at is not None and it >= slow_at else None
        for name, d in dets.items():
            det = d.observe(it, profiles_of(it, chunks, lens, plan, slow=slow, hide_lengths=name == "length-blind"))
            if det.report is not None:
                out[name]["reports"].append({"iteration": it, "devices": list(det.report.devices),
                                             "cause": det.report.cause})
    for name, d in dets.items():
        out[name].update(verifications=d.stats.verifications, change_points=d.stats.change_points,
                         benign=d.stats.benign)
    return out


def summary(traces: list[Chunks], lengths: list[dict], job: Any) -> dict[str, float]:
    plan, _ = job
    n = sum(lengths[0][(0, 0)])
    frac = [sum(l * l for l in ls) / (n * n) for lens in lengths for ls in lens.values()]
    its = [profiles_of(i, c, l, plan) for i, (c, l) in enumerate(zip(traces, lengths))]
    t = [max(p.iteration_s for p in ps.values()) for ps in its[1:]]
    mb = [f + b for c in traces for (f, b) in c.values()]
    return {
        "micro_batches": len(frac),
        "multi_document_share": sum(1 for lens in lengths for ls in lens.values() if len(ls) > 1) / len(frac),
        "sumsq_frac_min": min(frac), "sumsq_frac_mean": statistics.mean(frac),
        "chunk_s_min": min(mb), "chunk_s_median": statistics.median(mb), "chunk_s_max": max(mb),
        "iteration_s_median": statistics.median(t), "iteration_s_min": min(t), "iteration_s_max": max(t),
        "iteration_s_cv": statistics.pstdev(t) / statistics.mean(t),
    }


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized: N=512, 2 micro-batches, 32 iterations")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--iterations", type=int, help="per scenario; default 60 (quick 32)")
    ap.add_argument("--token-budget", type=int, help="override training.token_budget")
    ap.add_argument("--microbatches", type=int, help="override training.microbatches")
    ap.add_argument("--repeats", type=int, help="timings per chunk, minimum kept (default 2; quick 1)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="what a chunk's time is")
    ap.add_argument("--scenarios", default="shuffled,path", help="shuffled (the config's order) and/or path "
                    "(unshuffled, the window with the sharpest rise in attention work)")
    ap.add_argument("--slow-factor", type=float, default=WEAK, help="power check: chunk-time factor of the slow "
                    "device (default 1.54, docs/design.md's weak severity)")
    ap.add_argument("--slow-at", type=int, help="iteration of the power check's slowdown (default: 2/3 in)")
    a = ap.parse_args(argv)
    raw = json.loads(json.dumps(load_config(a.config, env={}).to_dict(include_secrets=False)))
    if a.quick:
        raw["training"].update(token_budget=512, microbatches=2)
    if a.token_budget:
        raw["training"]["token_budget"] = a.token_budget
    if a.microbatches:
        raw["training"]["microbatches"] = a.microbatches
    cfg = Config.from_dict(raw, source=str(a.config))
    iterations = a.iterations or (32 if a.quick else 60)
    repeats = a.repeats or (1 if a.quick else 2)
    slow_at = a.slow_at or (2 * iterations) // 3
    scenarios = a.scenarios.split(",")
    result: dict[str, Any] = {"config": str(a.config), "token_budget": cfg.training.token_budget,
                              "iterations": iterations, "repeats": repeats, "clock": a.clock, "scenarios": {}}
    for name in scenarios:
        if name not in ("shuffled", "path"):
            print(f"unknown scenario {name!r} (shuffled, path)", file=sys.stderr)
            return 1
        sc = cfg if name == "shuffled" else Config.from_dict(
            {**raw, "data": {**raw["data"], "shuffle": False}}, source=str(a.config))
        load0 = os.getloadavg()
        t0 = time.monotonic()
        try:
            first = 0 if name == "shuffled" else worst_window(sc, iterations)
            traces, lengths, job = record(sc, iterations, repeats, a.clock, first)
        except Exception as e:  # noqa: BLE001 - report why nothing was measured
            print(f"could not measure: {e!r}", file=sys.stderr)
            return 1
        rec_s = time.monotonic() - t0
        plan = job[0]
        healthy = replay(sc, traces, lengths, job)
        slow_device = plan.group(plan.dp - 1, plan.pp - 1)[0]
        power = replay(sc, traces, lengths, job, slow_at=slow_at, slow_device=slow_device, factor=a.slow_factor)
        info = summary(traces, lengths, job)
        load1 = os.getloadavg()
        tr = sc.training
        print(f"\n== {name}: documents in {'seeded shuffled' if name == 'shuffled' else 'path'} order, iterations "
              f"{first}-{first + iterations - 1}{' (the sharpest rise in attention work of the epoch)' if name == 'path' else ''}")
        print(f"corpus: {sc.data.section()}  N={tr.token_budget}  plan PP{plan.pp} x DP{plan.dp}, "
              f"m={plan.num_microbatches}; recorded in {rec_s:.0f} s ({a.clock} time, min of {repeats}); "
              f"load average {load0[0]:.1f} -> {load1[0]:.1f}")
        print(f"micro-batches: {info['micro_batches']}, {100 * info['multi_document_share']:.0f} % hold several "
              f"documents; sum l^2 / N^2 from {info['sumsq_frac_min']:.2f} (mean {info['sumsq_frac_mean']:.2f}); "
              f"chunk time {1e3 * info['chunk_s_min']:.1f}-{1e3 * info['chunk_s_max']:.1f} ms; iteration "
              f"{info['iteration_s_min']:.3f}-{info['iteration_s_max']:.3f} s (cv {100 * info['iteration_s_cv']:.1f} %)")
        head = (f"{'detector':<14}{'false alarms':>13}{'verifications':>15}{'change pts':>12}{'benign':>8}"
                f"{f'x{a.slow_factor:.2f} slow-down from it {slow_at} on device {slow_device}':>46}")
        print(head)
        print("-" * len(head))
        for det in healthy:
            h, p = healthy[det], power[det]
            found_at = [r for r in p["reports"] if r["iteration"] >= slow_at and slow_device in r["devices"]]
            early = [r for r in p["reports"] if r["iteration"] < slow_at]
            found = f"reported at it {found_at[0]['iteration']}" if found_at else "missed"
            print(f"{det:<14}{len(h['reports']):>13}{h['verifications']:>15}{h['change_points']:>12}"
                  f"{h['benign']:>8}{found + (f' ({len(early)} false before)' if early else ''):>46}")
        result["scenarios"][name] = {
            "first_iteration": first, "record_s": rec_s, "loadavg": [load0[0], load1[0]], "trace": info,
            "fault_free": healthy,
            "power_check": {"slow_at": slow_at, "device": slow_device, "factor": a.slow_factor, "detectors": power}}
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
