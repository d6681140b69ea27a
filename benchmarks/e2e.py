"""End-to-end throughput of a real resilient job (issue 7): paired, normalised ratios.

Every job is built by ``resihp_core.runtime.controller.jobs.build_job`` from a
:class:`~resihp_core.config.Config` (the path ``resihp demo`` and ``resihp run`` take):
the reference backend's LLaMA-style model (hidden 64, 4 heads, FFN 128, vocabulary
256, float32; 4 layers, 8 where noted), 1F1B, 256-token micro-batches (4 per replica
per iteration, 8 where noted), lr 3e-3, a checkpoint every iteration (build_job's
choice); build_job's long-tailed corpus for a 256-token budget (scale 25.6, lengths
4-256, seed 0). Detector as in the demo (a heartbeat every 0.1 s, 3 warm-up
iterations, change points at least 3 iterations apart) except that a worker is silent
only after 30 missed beats (3 s; the demo: 8): on a machine loaded 20x over, a starved
worker went 0.9 s without a beat and was reported hung. One thread
per worker process; one agent process per emulated node.

1. Fail-slow. A *medium* compute fail-slow (every compute chunk 2.22x longer: a 55 %
   throughput loss on a dedicated device) on one device from iteration 8; throughput
   with ResiHP (Detector -> Scheduler -> live reconfiguration) vs the same job with no
   mitigation. Target >= 1.3x. Each job is normalised by its own healthy phase
   (iterations 1..onset-1): retained = faulty-phase throughput / healthy throughput of
   the same job, and the figure is the ratio of retained fractions, ResiHP over no
   mitigation. Two jobs run one after the other do not run at the same speed even
   before the fault on a shared machine; the normalisation cancels that. The pair is
   repeated ``--reps`` times, the order alternating (interleaved), and the median is
   reported with its order-statistic interval (``benchmarks/benchstats.py``). The
   control (healthy ResiHP / healthy no mitigation) is printed next to every pair; a
   pair whose control is off by more than 3 standard errors of the two healthy phases
   (at least 2 %) is flagged and left out of the median. Reported over the whole faulty
   window (from the onset: detection and reconfiguration included) and in steady state
   (from the iteration after the first plan change). Layouts:

   - ``oversubscribed`` (4 workers/core here): TP2 x PP2 x DP2, 8 workers, 2 nodes of
     4. The injected slowdown sleeps, which hands the core to the other workers, so the
     unmitigated loss is far below 55 % and the ratio says as much about time-sharing
     as about ResiHP;
   - ``one_core_pp`` (one core per worker): TP1 x PP2 x DP1, 2 workers, 8 layers, 8
     micro-batches, one node; only layer repartition (PP) can help;
   - ``one_core_dp`` (one core per worker): TP1 x PP1 x DP2, 2 workers, 4 layers, 8
     micro-batches per replica, one node; only moving micro-batches across replicas
     (DP) can help.

   "One core per worker" needs ``nproc`` >= 2 (the controller, supervisor and agent
   share the cores, lightly). Each job also records ``background_cores``:
   the CPU other processes on the machine used meanwhile, in cores (from /proc/stat
   minus this process and its children: agents, workers); well above 0, the job did
   not have its cores.

2. Fail-stop (SIGKILL) of one device of the TP2 x PP2 x DP2 job: the recovered job's
   throughput vs a fresh job started with the best static plan on the same surviving
   workers (the better of the planner's plan deployed from scratch and the 4-device
   plan without the broken replica; both replace build_job's initial plan, with the
   planner state rebuilt for them). Target >= 90 %. Both are equally time-shared.
   The fresh jobs have no healthy phase of their own, so this ratio is not normalised;
   its repetitions are interleaved all the same, and a repetition whose three jobs saw
   background CPU use more than 0.3 cores apart is flagged and left out.

``--quick`` runs the two one-core layouts and the fail-stop, 2 pairs each; the full
run adds the oversubscribed layout, 3 pairs each (``--reps``).

Nothing is compared against the fault-free per-worker speed. Each job's failure
reports and plan changes are printed and kept in the JSON. Each job's scratch folder
(worker logs, checkpoints) goes to the temporary directory (``$TMPDIR``) and is removed
after the job unless it failed.

Usage: python benchmarks/e2e.py [--quick] [--reps N] [--json PATH] [--only NAME ...]
  NAME: oversubscribed, one_core_pp, one_core_dp, failstop (default: all)
Exit status: 0 measured; 1 a job failed (that measurement is left out, the others are
printed and written, with the error under "failed"); 2 measured, but a fail-slow job
with ResiHP never changed its plan (no steady-state ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from resihp_core.config import Config
from resihp_core.plan import ParallelPlan
from resihp_core.data import create_source
from resihp_core.predictor.predict import workload_features
from resihp_core.runtime.controller.resilient import ResilientConfig, run_resilient
from resihp_core.scheduler.state import PlannerState
from resihp_adapters.megatron_ref.plugin import CAPABILITIES
from resihp_core.runtime.controller.jobs import build_job
from resihp_core.faults import fail_at, severity_factor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchstats import Pair, loadavg, machine, median_ci, paired_ratio, rel_se  # noqa: E402

ONSET = 8  # fail-slow onset: after the Detector's warm-up (skip 1 + fit 3) and 4 healthy iterations
SEVERITY = "medium"
TARGET_FAILSLOW, TARGET_FAILSTOP = 1.3, 0.9

BASE = {
    "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "ffn_hidden": 128},
    "training": {"microbatches": 4, "token_budget": 256, "lr": 3e-3, "dtype": "float32"},
    "detector": {"heartbeat_interval_s": 0.1, "heartbeat_miss_limit": 30, "hang_min_timeout_s": 20.0,
                 "warmup_iterations": 3, "min_changepoint_gap": 3},
}


@dataclass(frozen=True)
class Setup:
    name: str
    what: str
    tp: int
    pp: int
    dp: int
    layers: int
    microbatches: int
    nodes: int
    devices_per_node: int
    victim: Callable[[ParallelPlan], int]  # the device that slows down
    iterations: tuple[int, int]  # (quick, full)

    @property
    def workers(self) -> int:
        return self.tp * self.pp * self.dp


SETUPS = {
    s.name: s
    for s in (
        Setup("oversubscribed", "TP2 x PP2 x DP2, 8 workers", 2, 2, 2, 4, 4, 2, 4,
              lambda p: p.group(1, 1)[0], (20, 36)),
        Setup("one_core_pp", "TP1 x PP2 x DP1, 2 workers, 8 layers (PP repartition)", 1, 2, 1, 8, 8, 1, 2,
              lambda p: p.group(0, 1)[0], (30, 48)),
        Setup("one_core_dp", "TP1 x PP1 x DP2, 2 workers (DP migration)", 1, 1, 2, 4, 8, 1, 2,
              lambda p: p.group(1, 0)[0], (30, 48)),
    )
}
FAILSTOP = SETUPS["oversubscribed"]
QUICK_SETUPS = ("one_core_pp", "one_core_dp")
KILL_AT = 4
BACKGROUND_TOLERANCE = 0.3  # cores: a repetition whose runs saw more different loads is flagged
FRESH_PLAN: dict = {}  # the planner's plan for the survivors, from the first killed job


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def config(setup: Setup, iterations: int) -> Config:
    data = {**BASE,
            "parallel": {"tp": setup.tp, "pp": setup.pp, "dp": setup.dp},
            "model": {**BASE["model"], "layers": setup.layers},
            "training": {**BASE["training"], "microbatches": setup.microbatches, "iterations": iterations},
            "runtime": {"nodes": setup.nodes, "devices_per_node": setup.devices_per_node}}
    return Config.from_dict(data, source="benchmarks/e2e.py")


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, irq, softirq, steal = v[0], v[1], v[2], v[5], v[6], v[7] if len(v) > 7 else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its reaped descendants (agents, workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def run(cfg: Config, faults: list, supervised: bool, tag: str, plan: ParallelPlan | None = None,
        iterations: int | None = None):
    """One job from ``cfg``; ``plan`` replaces build_job's uniform initial plan (a fresh
    job on a given layout), with the planner state rebuilt for it. Sets
    ``out.extra["background_cores"]``: the cores' worth of CPU other processes on the
    machine used meanwhile (None where unknown)."""
    work = Path(tempfile.mkdtemp(prefix=f"resihp-e2e-{tag}-"))
    plan0, topology, spec, state, planner, _ = build_job(cfg, faults, work)
    if plan is not None:
        plan.validate(topology)
        source = create_source(spec.data, dp=plan.dp, num_microbatches=plan.num_microbatches, seed=spec.seed)
        feats = workload_features(source.workload(0), plan.dp, plan.num_microbatches)
        state = PlannerState.create(topology, plan, state.predictor, feats, capabilities=CAPABILITIES,
                                    k_min=cfg.scheduler.k_min, delta=cfg.scheduler.delta)
        plan0 = plan
    busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
    out = run_resilient(ResilientConfig(spec=spec, plan=plan0, topology=topology, state=state, planner=planner,
                                        detector=cfg.detector, iterations=iterations or cfg.training.iterations,
                                        workdir=work / "job", supervised=supervised, timeout_s=1200))
    busy1, own1, wall = _busy_cpu_s(), _own_cpu_s(), time.monotonic() - t0
    out.extra["background_cores"] = (None if busy0 is None or busy1 is None
                                     else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall)
    if not out.ok:
        raise RuntimeError(f"{tag}: {out.error} (logs in {out.logs})")
    shutil.rmtree(work, ignore_errors=True)  # checkpoints of every iteration: ~200 MB a job
    return out


def throughput(records, first: int, last: int | None = None) -> float:
    rows = [r for r in records if r.iteration >= first and (last is None or r.iteration <= last)]
    if not rows:
        raise RuntimeError(f"no iterations in [{first}, {last}]")
    return sum(r.samples for r in rows) / sum(r.seconds for r in rows)


def healthy(records, last: int) -> tuple[float, float]:
    """Throughput of iterations 1..``last`` (iteration 0 carries one-time costs) and its
    relative standard error from the per-iteration spread (of seconds per sample: the
    throughput is total samples over total seconds)."""
    rows = [r for r in records if 1 <= r.iteration <= last]
    return throughput(records, 1, last), rel_se([r.seconds / r.samples for r in rows])


def plan_events(out) -> list[str]:
    return [f"it {e['iteration']} gen {e['generation']} {e['kind']}: {e['text']}"
            for e in out.events if e["kind"] in ("failure", "plan") and e["generation"] >= 0]


def fail_slow_pair(setup: Setup, iterations: int, rep: int) -> dict:
    """One repetition: the unmitigated job and the ResiHP job, one after the other (the
    order alternates between repetitions, so a drift of the machine hits both alike)."""
    cfg = config(setup, iterations)
    plan = build_job(cfg, [], Path(tempfile.gettempdir()))[0]
    victim = setup.victim(plan)
    faults = [fail_at(victim, ONSET, "slow", severity=SEVERITY)]
    runs = {}
    order = ("nomit", "resihp") if rep % 2 == 0 else ("resihp", "nomit")
    for which in order:
        runs[which] = run(cfg, faults, which == "resihp", f"{setup.name}-{which}-r{rep}")
    base, ours = runs["nomit"], runs["resihp"]
    adapted = next((r.iteration for r in ours.records if r.generation > 0), None)
    plans = [e for e in ours.events if e["kind"] == "plan" and e["generation"] >= 1]
    first_failure = next((e for e in ours.events if e["kind"] == "failure"), None)
    (hb, hb_se), (ho, ho_se) = healthy(base.records, ONSET - 1), healthy(ours.records, ONSET - 1)
    res = {
        "order": list(order),
        "slow_device": victim,
        "adapted_at_iteration": adapted,
        "plan_changes": len(plans),
        "first_failure_reported": first_failure.get("failure") if first_failure else None,
        "nomit_healthy_samples_per_s": hb, "nomit_healthy_rse": hb_se,
        "resihp_healthy_samples_per_s": ho, "resihp_healthy_rse": ho_se,
        "nomit_window_samples_per_s": throughput(base.records, ONSET),
        "resihp_window_samples_per_s": throughput(ours.records, ONSET),
        "background_cores_nomit": base.extra["background_cores"],
        "background_cores_resihp": ours.extra["background_cores"],
        "final_plan": ours.final_plan.to_text() if ours.final_plan is not None else None,
        "events": plan_events(ours),
    }
    res["nomit_retained_window"] = res["nomit_window_samples_per_s"] / hb
    res["resihp_retained_window"] = res["resihp_window_samples_per_s"] / ho
    if adapted is not None and adapted + 1 < iterations:
        res["steady_from_iteration"] = adapted + 1
        res["nomit_steady_samples_per_s"] = throughput(base.records, adapted + 1)
        res["resihp_steady_samples_per_s"] = throughput(ours.records, adapted + 1)
    return res


def _pair(r: dict, phase: str) -> Pair:
    return Pair(a_healthy=r["resihp_healthy_samples_per_s"], a_faulty=r[f"resihp_{phase}_samples_per_s"],
                b_healthy=r["nomit_healthy_samples_per_s"], b_faulty=r[f"nomit_{phase}_samples_per_s"],
                a_healthy_rse=r["resihp_healthy_rse"], b_healthy_rse=r["nomit_healthy_rse"])


def fail_slow(setup: Setup, iterations: int, reps: int) -> dict:
    """``reps`` interleaved pairs; the ratio of retained fractions (faulty / own healthy
    phase, ResiHP over no mitigation) with its median and order-statistic interval."""
    pairs = [fail_slow_pair(setup, iterations, k) for k in range(reps)]
    n = cores()
    window = paired_ratio([_pair(r, "window") for r in pairs])
    steady_pairs = [r for r in pairs if "resihp_steady_samples_per_s" in r]
    steady = paired_ratio([_pair(r, "steady") for r in steady_pairs]) if steady_pairs else None
    return {
        "layout": setup.what,
        "workers": setup.workers,
        "cores": n,
        "workers_per_core": setup.workers / n,
        "slow_factor": severity_factor(SEVERITY),
        "iterations": iterations,
        "onset_iteration": ONSET,
        "repetitions": reps,
        "ratio_window": window.ratio.median,
        "ratio_window_ci": [window.ratio.lo, window.ratio.hi],
        "ratio_window_ci_confidence": window.ratio.confidence,
        "ratio_steady": steady.ratio.median if steady else None,
        "ratio_steady_ci": [steady.ratio.lo, steady.ratio.hi] if steady else None,
        "healthy_ratio_control": window.control.median,
        "controls": window.controls,
        "flagged_pairs": window.flagged,
        "ratio_window_unnormalised": window.raw_ratio.median if window.raw_ratio else None,
        "nomit_retained_window": statistics.median(r["nomit_retained_window"] for r in pairs),
        "resihp_retained_window": statistics.median(r["resihp_retained_window"] for r in pairs),
        "window": window.to_dict(),
        "steady": steady.to_dict() if steady else None,
        "pairs": pairs,
    }


def fail_stop_pair(iterations: int, rep: int) -> dict:
    """One repetition: the killed-and-recovered job, and fresh jobs on its survivors (the
    planner's plan from scratch; the 4-device plan without the broken replica), the
    order alternating between repetitions."""
    setup = FAILSTOP
    cfg = config(setup, iterations)
    plan = build_job(cfg, [], Path(tempfile.gettempdir()))[0]
    victim = plan.group(0, 0)[1]
    kill_at = KILL_AT
    tp, pp, m = setup.tp, setup.pp, setup.microbatches
    r1 = ParallelPlan.uniform(tp=tp, pp=pp, dp=1, num_layers=setup.layers, num_microbatches=m * setup.dp,
                              num_heads=cfg.model.heads, devices=[*plan.group(1, 0), *plan.group(1, 1)])
    assert victim not in r1.devices()
    out: dict = {}

    def killed() -> None:
        rec = run(cfg, [fail_at(victim, kill_at, "kill")], True, f"kill-r{rep}")
        after = next(r.iteration for r in rec.records if r.generation > 0)
        h, h_se = healthy(rec.records, kill_at - 1)
        out.update(rec=rec, after=after, healthy=h, healthy_rse=h_se,
                   recovered=throughput(rec.records, after + 1))

    def fresh() -> None:
        # The planner's plan for the survivors is only known once a killed job ran; it
        # is deterministic, so later repetitions may run the fresh jobs first with it.
        n = max(6, iterations - kill_at - 1)
        fp = out["recovered_plan"] if "recovered_plan" in out else FRESH_PLAN["plan"]
        out["fresh_runs"] = {
            "fresh": run(cfg, [], True, f"fresh-r{rep}", plan=fp.with_(generation=0), iterations=n),
            "dp1": run(cfg, [], True, f"dp1-r{rep}", plan=r1, iterations=n),
        }

    first_killed = rep % 2 == 0 or "plan" not in FRESH_PLAN
    out["order"] = ["killed", "fresh"] if first_killed else ["fresh", "killed"]
    for step in ((killed, fresh) if first_killed else (fresh, killed)):
        step()
        if step is killed:
            out["recovered_plan"] = out["rec"].final_plan
            FRESH_PLAN.setdefault("plan", out["recovered_plan"])
    fr, single, rec = out["fresh_runs"]["fresh"], out["fresh_runs"]["dp1"], out["rec"]
    best_name, best_run = max((("fresh_planner_plan", fr), ("fresh_dp1", single)),
                              key=lambda t: throughput(t[1].records, 1))
    best = throughput(best_run.records, 1)
    bg = [r.extra["background_cores"] for r in (rec, fr, single)]
    return {
        "order": out["order"],
        "killed_device": victim,
        "kill_iteration": kill_at,
        "recovered_at_iteration": out["after"],
        "healthy_before_kill_samples_per_s": out["healthy"],
        "healthy_before_kill_rse": out["healthy_rse"],
        "recovered_samples_per_s": out["recovered"],
        "recovered_retained": out["recovered"] / out["healthy"],
        "recovered_rse": rel_se([r.seconds / r.samples for r in rec.records if r.iteration > out["after"]]),
        "fresh_planner_plan_samples_per_s": throughput(fr.records, 1),
        "fresh_dp1_samples_per_s": throughput(single.records, 1),
        "best_static": best_name,
        "best_static_rse": rel_se([r.seconds / r.samples for r in best_run.records if r.iteration >= 1]),
        "ratio_vs_best_static": out["recovered"] / best,
        "background_cores": bg,
        "recovered_plan": out["recovered_plan"].to_text(),
        "events": plan_events(rec),
    }


def fail_stop(iterations: int, reps: int) -> dict:
    """``reps`` interleaved repetitions. The fresh jobs have no healthy phase of their
    own (they start on the survivors), so the fail-stop ratio cannot be normalised like
    the fail-slow one; its control is the machine's other load: a repetition whose runs
    saw background CPU use differing by more than ``BACKGROUND_TOLERANCE`` cores is
    flagged and left out."""
    FRESH_PLAN.clear()
    pairs = [fail_stop_pair(iterations, k) for k in range(reps)]
    flagged = [i for i, r in enumerate(pairs)
               if None not in r["background_cores"]
               and max(r["background_cores"]) - min(r["background_cores"]) > BACKGROUND_TOLERANCE]
    kept = median_ci([r["ratio_vs_best_static"] for i, r in enumerate(pairs) if i not in flagged])
    return {
        "layout": FAILSTOP.what,
        "repetitions": reps,
        "ratio_vs_best_static": kept.median,
        "ratio_vs_best_static_ci": [kept.lo, kept.hi],
        "ratio_ci_confidence": kept.confidence,
        "ratios": [r["ratio_vs_best_static"] for r in pairs],
        "flagged_pairs": flagged,
        "control": "background CPU use of the 3 runs of a repetition (cores), within "
                   f"{BACKGROUND_TOLERANCE} of each other",
        "recovered_retained": median_ci([r["recovered_retained"] for r in pairs]).to_dict(),
        "pairs": pairs,
    }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:10.3f}"
    if isinstance(v, list):
        return " ".join(_fmt(x).strip() for x in v)
    return f"{'-' if v is None else v!s:>10}"


def _ci(med, ci, conf) -> str:
    if med is None or med != med:  # None or NaN: no pair left
        return "-"
    if conf == 0:
        return f"{med:.2f} (one pair: no interval)"
    return f"{med:.2f} [{ci[0]:.2f} .. {ci[1]:.2f}, {100 * conf:.0f} % CI]"


def report(results: dict) -> None:
    for name, res in results.items():
        if name == "failstop":
            print(f"\n== fail-stop: {res['layout']} ({cores()} cores), {res['repetitions']} interleaved repetitions")
            print("  rep  killed  recovered@  healthy/s  recovered/s  retained  fresh plan/s  fresh dp1/s  ratio"
                  "  background cores")
            for k, r in enumerate(res["pairs"]):
                print(f"  {k:>3}  {r['killed_device']:>6}  {r['recovered_at_iteration']:>10}  "
                      f"{r['healthy_before_kill_samples_per_s']:>9.2f}  {r['recovered_samples_per_s']:>11.2f}  "
                      f"{r['recovered_retained']:>8.2f}  {r['fresh_planner_plan_samples_per_s']:>12.2f}  "
                      f"{r['fresh_dp1_samples_per_s']:>11.2f}  {r['ratio_vs_best_static']:>5.2f}  "
                      + " ".join(f"{b:.2f}" if b is not None else "-" for b in r["background_cores"])
                      + ("  FLAGGED (left out)" if k in res["flagged_pairs"] else ""))
            for line in res["pairs"][0]["events"]:
                print(f"    {line[:200]}")
            continue
        per = res["workers_per_core"]
        kind = "one core per worker" if per <= 1 else f"oversubscribed {per:g} workers/core"
        print(f"\n== fail-slow [{name}] {kind}: {res['layout']} on {res['cores']} cores, "
              f"{res['repetitions']} interleaved pairs")
        print("  rep  order          healthy/s nomit  resihp  control (tolerance)  retained nomit  resihp  "
              "ratio(window)  ratio(steady)  adapted@  background cores")
        for k, r in enumerate(res["pairs"]):
            pw = _pair(r, "window")
            st = f"{_pair(r, 'steady').ratio:13.2f}" if "resihp_steady_samples_per_s" in r else f"{'-':>13}"
            print(f"  {k:>3}  {'/'.join(r['order']):13s}  {r['nomit_healthy_samples_per_s']:>13.2f}  "
                  f"{r['resihp_healthy_samples_per_s']:>6.2f}  {pw.control:>7.2f} (±{max(3 * pw.control_noise, 0.02):.2f})  "
                  f"{r['nomit_retained_window']:>14.2f}  {r['resihp_retained_window']:>6.2f}  {pw.ratio:>13.2f}  "
                  f"{st}  {_fmt(r['adapted_at_iteration']).strip():>8}  "
                  + " ".join(f"{b:.2f}" if b is not None else "-"
                             for b in (r["background_cores_nomit"], r["background_cores_resihp"]))
                  + ("  FLAGGED: control off by more than its noise (left out)"
                     if k in res["flagged_pairs"] else ""))
        for line in res["pairs"][0]["events"]:
            print(f"    {line[:200]}")
    print("\n== targets (medians of the ratio of retained fractions; flagged pairs left out)")
    for name, res in results.items():
        if name == "failstop":
            r = res["ratio_vs_best_static"]
            print(f"  fail-stop recovered / best fresh static >= {TARGET_FAILSTOP}: "
                  f"{_ci(r, res['ratio_vs_best_static_ci'], res['ratio_ci_confidence'])} "
                  f"{'met' if r >= TARGET_FAILSTOP else 'NOT met'}"
                  f"  [{len(res['flagged_pairs'])} of {res['repetitions']} flagged]")
            continue
        w, s = res["ratio_window"], res.get("ratio_steady")
        wtxt = _ci(w, res["ratio_window_ci"], res["window"]["ratio"]["confidence"])
        stxt = (_ci(s, res["ratio_steady_ci"], res["steady"]["ratio"]["confidence"]) if s is not None
                else "- (never adapted)")
        print(f"  fail-slow [{name}, {res['workers_per_core']:g} workers/core] ResiHP / no mitigation >= "
              f"{TARGET_FAILSLOW}x: window {wtxt} {'met' if w >= TARGET_FAILSLOW else 'NOT met'}; "
              f"steady {stxt}  [control {res['healthy_ratio_control']:.2f}, "
              f"{len(res['flagged_pairs'])} of {res['repetitions']} flagged; unnormalised "
              f"{res['ratio_window_unnormalised']:.2f}]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (CI)")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--only", action="append", choices=[*SETUPS, "failstop"],
                    help="run only this measurement (repeatable)")
    ap.add_argument("--reps", type=int, help="interleaved repetitions of every comparison (default 3; quick 2)")
    args = ap.parse_args(argv)
    # --quick: the one-core layouts and the fail-stop only (the oversubscribed layout
    # measures time-sharing more than ResiHP, and costs the most).
    which = args.only or ([*QUICK_SETUPS, "failstop"] if args.quick else [*SETUPS, "failstop"])
    reps = args.reps or (2 if args.quick else 3)
    load0 = loadavg()
    results: dict = {}
    failed: dict[str, str] = {}
    for name in which:
        try:
            if name == "failstop":
                results[name] = fail_stop(FAILSTOP.iterations[0 if args.quick else 1], reps)
            else:
                s = SETUPS[name]
                results[name] = fail_slow(s, s.iterations[0 if args.quick else 1], reps)
        except Exception as e:  # noqa: BLE001 - say which measurement, go on with the others
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"could not measure {name}: {failed[name]}", file=sys.stderr)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "failed": failed,
                                               "config": {"quick": args.quick, "cores": cores(), "reps": reps,
                                                          "onset": ONSET, "severity": SEVERITY,
                                                          "loadavg_before": load0, "loadavg_after": loadavg(),
                                                          "machine": machine()}}, indent=2))
    if failed:
        return 1
    missing = [n for n, r in results.items() if n != "failstop" and r.get("ratio_steady") is None]
    if missing:
        print(f"no plan change after the fail-slow in: {', '.join(missing)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
