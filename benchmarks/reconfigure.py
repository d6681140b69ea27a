"""Reconfiguration cost and predictor fidelity on real multi-process runs (issue 5).

Measures, on the reference backend with gloo on this machine:
1. SIGKILL of one TP member of a TP2 x PP2 x DP2 job (8 workers) -> time until the first
   iteration commits under the new plan (detection by process exit, generation abort,
   communicator rebuild, re-sharding from a DP peer, one iteration), with the breakdown.
2. Layer migration time vs bytes moved (planned layer repartitions, 2 workers).
3. The predictor's iteration-time MAPE: per-stage cost fitted on warm-up iterations'
   per-micro-batch profiles, then predicted vs measured on held-out iterations
   (2 workers, PP2: one core each on a 2-core machine, so stages really run in parallel).
   The job runs several times (same data per iteration): each held-out iteration's
   time is the median of its runs, and the standard errors of those medians give the
   noise floor the MAPE is printed next to (as in predictor_accuracy.py).

With ``--adapter deepspeed`` it measures ResiHP's DeepSpeed adapter instead:
1. SIGKILL of one rank of a PP2 x DP2 DeepSpeed job (4 workers, the toy MLP pipeline,
   ZeRO 0) -> time until the first iteration commits under the new plan (the broken
   replica keeps its stage-0 rank busy, its stage-1 micro-batches migrate to the other
   replica), with the breakdown, median and max of 5; survivors keep their processes.
   After each repetition the best static plan for the 3 survivors (PP3 x DP1, layers
   2/2/2, the same global batch) runs fresh and fault-free, and the post-failure
   iteration time (median of 6 iterations after 3) is divided by its (the same count):
   the median of the 5 ratios is printed. ``--kill-only`` skips item 2. With ``--restore-at I,J`` (ZeRO 1: the killed rank's
   optimizer shard is lost): kill -> the killed iteration committed again through a
   restore from the newest checkpoint (every 10), after I and after J iterations.
2. Fault-free iteration time of ResiHP's engine vs DeepSpeed's stock ``PipelineEngine``
   (``deepspeed.initialize`` + ``train_batch``): both built in the same 4 processes and
   world, stepped alternately (medians of the slowest rank per iteration).

With ``--adapter torch_native`` it measures instead, on the torch-native adapter
(torch.distributed.pipelining + FSDP2, 4 workers, PP2 x DP2): SIGKILL of one rank ->
first committed iteration, once with HSDP (state re-sharded from the surviving copy in
memory, the survivors re-split into 3 stages) and once with FSDP2 (the dead rank's shard
is lost: restore from the last torch.distributed.checkpoint onto the 3 survivors);
then the fault-free iteration time of the resilient path (``resihp run``'s production
path: agents, controller, detector, supervisor, the commit protocol) against the stock
path (``PipelineStage`` + ``Schedule1F1B`` + ``fully_shard``, HSDP, under ``torchrun``,
no ResiHP) on the same PP2 x DP2 job, model and data, alternated in one run (medians over
runs of each run's seconds per iteration after a warm-up; ``--fault-free-only`` runs just this);
the resilient path runs twice per round, its commit overlapped with the next iteration (the
default) and in line (``RESIHP_COMMIT_OVERLAP=0``). ``--fault-free-phases`` times each part of
those iterations in every worker instead (snapshot, report, commit, schedule, optimizer).

With ``--controller-restart`` it measures controller failover instead (docs/failover.md):
a ``resihp run`` job (megatron_ref, TP1 x PP2 x DP2, 2 nodes) whose controller is
SIGKILLed at iteration 8 and restarted with ``--resume`` at once: restart -> re-attached
(the new process's start-up, the agents dialling back) and restart -> first committed
iteration, median of 3 (1 with ``--quick``).

With ``--restore-at 30,300`` (``--adapter deepspeed``: the DeepSpeed variant above): torch_native
FSDP2 PP2 x DP2, one rank SIGKILLed (its shard
is lost) after 30 and after 300 iterations of the same job, checkpoints every 10: kill ->
the killed iteration committed again through a restore from the checkpoint the
supervisor's rule picks (median of 3, 1 with ``--quick``); the two agree when nothing
is replayed from the start.

With ``--adapter torch_native --tp 2``: the user's tiny HF LLaMA under TP2 x PP2 x DP1
(DTensor TP), SIGKILL of a device of stage 1's TP group -> first committed iteration with
that group shrunk to TP1 (state from memory), and the fault-free iteration time of the
resilient TP path against stock torch (parallelize_module + PipelineStage +
Schedule1F1B) in alternating blocks of the same 4 processes.

With ``--adapter torch_native --model hf_llama --fault-free-only``: the user's HF LLaMA
script itself (examples/hf_llama/train.py, unchanged) under ``accelerate launch`` (stock
torch) and under ``resihp launch``, alternated, no checkpoints: fault-free iteration
time of the resilient path against the stock one (``hf_fault_free``).

Usage: python benchmarks/reconfigure.py [--adapter megatron_ref|deepspeed|torch_native] [--model llama|hf_llama]
       [--tp 1|2]
       [--controller-restart] [--fault-free-only] [--fault-free-phases] [--fault-free-rounds N]
       [--restore-at 30,300] [--kills N] [--kill-only]
       [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from resihp_core.plan import ParallelPlan, Topology, ranges_from_counts
from resihp_core.predictor.cost import CostModel, LinkModel, fit_stage, mape
from resihp_core.predictor.predict import IterationPredictor, ModelShape
from resihp_core.runtime.controller.launcher import LocalJob
from resihp_core.scheduler.planner import PlanDecision, Planner
from resihp_adapters.megatron_ref.data import lengths_of
from resihp_core.job import JobSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchstats import floor_corrected, median_ci  # noqa: E402


def spec(dp, m, hidden=32, layers=4, tokens=64, heads=4, ffn=64, vocab=64, scale=12.0, **kw):
    return JobSpec(
        adapter="megatron_ref",
        adapter_config=dict(vocab_size=vocab, hidden=hidden, num_heads=heads, ffn_hidden=ffn,
                            num_layers=layers, dtype="float32"),
        data=dict(source="synthetic", scale=scale, shape=1.0, min_len=2, max_len=tokens, token_budget=tokens),
        dp=dp, num_microbatches=m, timeout_s=10.0, **kw,
    )


def timed_kill(job: LocalJob, plan: ParallelPlan, victim: int, after: ParallelPlan, timeout: float,
               restore: bool = False, warm: int = 3, every: int = 1, checkpoint_dir: str | None = None) -> dict:
    """Train ``plan`` ``warm`` iterations, SIGKILL ``victim``'s worker, post ``after`` from
    the first uncommitted iteration (if ``restore``: from the checkpoint the supervisor's
    rule picks, checkpoints every ``every``) and time kill -> detected -> first committed
    iteration; then 2 more iterations for the steady iteration time after it."""
    from resihp_core.checkpoints import restore_point

    job.post(plan, iterations=max(1000, warm + 10))
    job.wait(warm, timeout=timeout)
    t_kill = time.perf_counter()
    job.kill(victim, signal.SIGKILL, reap=False)
    while victim not in job.dead():
        time.sleep(0.0005)
    t_detect = time.perf_counter()
    resume = job.abort()
    point = restore_point(checkpoint_dir, resume, every)[0] if restore else None
    if restore and point is None:
        raise RuntimeError(f"no complete checkpoint before iteration {resume}")
    start = resume if point is None else point + 1
    job.post(after, iterations=max(1000, warm + 10), resume=start, restore=point)
    job.wait(resume + 1, timeout=timeout)
    t_first = time.perf_counter()
    info = job.ready_info()
    job.wait(resume + 3, timeout=timeout)
    steady = [max(r.iteration_s for r in job.report(i).values()) for i in (resume + 1, resume + 2)]
    return dict(kill_to_first_iteration_s=t_first - t_kill, detect_s=t_detect - t_kill,
                killed_at=resume, resumed_at=start, redone=resume - start,
                rebuild_s=max(v["rebuild_s"] for v in info.values()),
                state_s=max(v["state_s"] for v in info.values()),
                bytes_moved=sum(v["bytes_received"] for v in info.values()),
                iteration_after_s=statistics.median(steady))


def kill_to_iteration(reps: int) -> dict:
    rows = []
    for _ in range(reps):
        js = spec(dp=2, m=4)
        plan = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4, num_heads=4)
        victim = plan.group(0, 1)[1]
        groups = [list(r) for r in plan.tp_groups]
        groups[0][1] = groups[0][1][:1]
        shrunk = plan.with_(tp_groups=tuple(tuple(r) for r in groups), excluded=frozenset([victim]))
        with LocalJob(js.to_json(), plan.devices()) as job:
            rows.append(timed_kill(job, plan, victim, shrunk, timeout=120))
    ci = median_ci([r["kill_to_first_iteration_s"] for r in rows])
    return ({k: statistics.median(r[k] for r in rows) for k in rows[0]}
            | {"repetitions": reps, "kill_to_first_iteration_range_s": [ci.lo, ci.hi],
               "kill_to_first_iteration_ci_confidence": ci.confidence})


#: The adapter's LLaMA for torch_native's kill measurements.
TN_MODEL = dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, ffn_dim=128, dtype="float32")


def _pp2dp2_kill_plans() -> tuple[ParallelPlan, int, ParallelPlan]:
    """PP2 x DP2, the victim (stage 1 of replica 0), and the 3 survivors as PP3."""
    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    victim = base.group(1, 0)[0]
    survivors = [d for d in base.devices() if d != victim]
    three = ParallelPlan(num_layers=4, layer_ranges=((0, 1), (1, 2), (2, 4)),
                         tp_groups=(tuple((d,) for d in survivors),), num_microbatches=8,
                         excluded=frozenset([victim]))
    return base, victim, three


def torch_native_kill(reps: int, hf: bool = False) -> dict:
    """torch_native: kill -> first committed iteration, in memory (HSDP) and from DCP (FSDP2).
    ``hf``: the user's tiny HF LLaMA of examples/hf_llama (AdamW, warm-up + cosine,
    clipping, float64) through ``adapter_config.user`` instead of the adapter's LLaMA."""
    model = TN_MODEL
    env = None
    if hf:
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_llama")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    base, victim, three = _pp2dp2_kill_plans()
    out = {}
    for label, shard, restore in (("hsdp_memory", 1, False), ("fsdp2_dcp", 0, True)):
        rows = []
        for _ in range(reps):
            ckpt = tempfile.mkdtemp(prefix="resihp-bench-ckpt-")
            js = JobSpec(adapter="torch_native",
                         adapter_config={"shard": shard, **({"user": "hf_model:user_llama"} if hf else
                                                            {"model": model})},
                         data={"source": "synthetic", "token_budget": 64}, dp=2, num_microbatches=4, timeout_s=10.0, checkpoint_dir=ckpt,
                         checkpoint_every=1 if restore else 0)
            with LocalJob(js.to_json(), base.devices(), env=env) as job:
                row = timed_kill(job, base, victim, three, timeout=180, restore=restore, checkpoint_dir=ckpt)
                before = [max(r.iteration_s for r in job.report(i).values()) for i in (1, 2)]
            rows.append(row | {"iteration_before_s": statistics.median(before)})
        out[label] = {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"repetitions": reps}
    return out


def _restore_at(points: list[int], reps: int, every: int, plans: tuple[ParallelPlan, int, ParallelPlan],
                job_spec: Callable[[str], JobSpec], timeout: float) -> dict:
    """Kill -> the killed iteration committed again on the restore path, after each of
    ``points`` iterations of a fresh job (``job_spec(checkpoint_dir)``), median of ``reps``.

    The job runs as ``resihp run`` runs one: assembled (``assemble_spec``), then
    ``run_resilient`` (controller, node agent, the supervisor's control loop). The victim's
    worker is SIGKILLed once ``point`` iterations committed; the supervisor notices,
    plans (the scripted answer: ``after`` as a restore decision), restores the checkpoint
    its rule picks and resumes after it. It restores at once (``move_before_restore``
    off): ``after`` is not a layout the Scheduler's state can hold, so the supervisor's
    own restore after a ``StateLost`` could not post it."""
    from dataclasses import replace

    from resihp_core.runtime.controller.assemble import assemble_spec
    from resihp_core.runtime.controller.resilient import run_resilient
    from resihp_core.protocols.events import Failure, JobEvent, PlanPosted, observer
    from resihp_core.runtime.controller.runconfig import RunHooks

    base, victim, after = plans
    out = {}
    for point in points:
        rows = []
        for rep in range(reps):
            ckpt = tempfile.mkdtemp(prefix="resihp-bench-ckpt-")
            # Heartbeats may lag on a loaded machine: only the kill (a process exit, seen at
            # once by its agent) is a failure here. The fail-slow Detector stays in its
            # warm-up for the whole job: at load 50 it took contention for a slow device and
            # the measurement stopped on a failure it did not cause.
            asm = assemble_spec(job_spec(ckpt), base, iterations=point + 3,
                                workdir=Path(tempfile.mkdtemp(prefix="resihp-rst-")),
                                detector={"heartbeat_miss_limit": 600, "hang_min_timeout_s": 120.0,
                                          "warmup_iterations": 1_000_000})
            t: dict[str, float] = {}
            jobs: list[LocalJob] = []
            restores: list[PlanPosted] = []

            def on_iteration(rec, point=point, t=t, jobs=jobs) -> None:
                if rec.iteration == point - 1 and "kill" not in t:
                    pid = jobs[0].processes.pids[victim]
                    t["kill"] = time.perf_counter()
                    os.kill(pid, signal.SIGKILL)  # the agent's child, by its pid
                elif "kill" in t and rec.iteration >= point and "first" not in t:
                    t["first"] = time.perf_counter()

            def on_event(ev: JobEvent, t=t, restores=restores) -> None:
                if isinstance(ev, Failure) and "kill" in t and "detect" not in t:
                    t["detect"] = time.perf_counter()
                if isinstance(ev, PlanPosted) and ev.restore is not None:
                    t.setdefault("restored", time.perf_counter())
                    restores.append(ev)

            run = replace(asm.run, planner=_ScriptedRestore(after, victim), timeout_s=timeout,
                          move_before_restore=False, hooks=RunHooks(
                observe=observer(iteration=on_iteration, job=on_event),
                before_run=lambda job, agents, jobs=jobs: jobs.append(job)))
            res = run_resilient(run)
            if not res.ok or "first" not in t or not restores:
                raise RuntimeError(f"no restore measured after {point} iterations ({res.error or 'no restore'}; "
                                   f"logs {res.logs})")
            ev = restores[0]
            rows.append(dict(kill_to_first_iteration_s=t["first"] - t["kill"], detect_s=t["detect"] - t["kill"],
                             kill_to_restore_posted_s=t["restored"] - t["kill"], killed_at=point,
                             restored_from=ev.restore, resumed_at=ev.resume, redone=point - ev.resume))
            print(f"  kill after {point} iterations, run {rep + 1}: "
                  f"{rows[-1]['kill_to_first_iteration_s']:.3f} s, resumed at {rows[-1]['resumed_at']} "
                  f"({rows[-1]['redone']} redone)", flush=True)
        out[f"at_{point}"] = {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"repetitions": reps}
    return out


class _ScriptedRestore(Planner):
    """The restore-at measurement's planner: whatever fails, ``after`` as a restore
    decision (the plan is fixed so the two points measure the same reconfiguration)."""

    def __init__(self, after: ParallelPlan, victim: int) -> None:
        super().__init__(stages=())
        self.after, self.victim = after, victim

    def plan(self, state, report=None) -> PlanDecision:
        devices = set(report.devices if report is not None else ())
        if devices - {self.victim}:
            raise RuntimeError(f"a failure the benchmark did not cause: {report}")
        failed = frozenset(state.failed | devices)
        return PlanDecision(plan=self.after, kind="restore", reason="benchmark: the killed rank's shard is lost",
                            predicted_time=0.0, timings={}, state=state.with_health(failed=failed))

    def rejoin(self, state, devices) -> PlanDecision:
        raise RuntimeError(f"devices {sorted(devices)} offered back; the benchmark repairs none")


def torch_native_restore_at(points: list[int], reps: int, every: int = 10) -> dict:
    """torch_native FSDP2 (a SIGKILLed rank takes its shard): kill -> the killed
    iteration committed again, on the restore path, for a kill after ``points``
    iterations of the same job (checkpoint every ``every``; the restore point by the
    supervisor's rule). Without replay from the start the figures do not grow with the
    point (docs/checkpoints.md)."""
    return _restore_at(points, reps, every, _pp2dp2_kill_plans(), lambda ckpt: JobSpec(
        adapter="torch_native", adapter_config={"shard": 0, "model": TN_MODEL},
        data={"source": "synthetic", "token_budget": 64}, dp=2, num_microbatches=4, timeout_s=10.0,
        checkpoint_dir=ckpt, checkpoint_every=every, checkpoint_keep=2), timeout=600)


def _main_restore_at(args) -> int:
    points = [int(x) for x in args.restore_at.split(",")]
    reps = 1 if args.quick else 3
    ds = args.adapter == "deepspeed"
    try:
        res = ds_restore_at(points, reps) if ds else torch_native_restore_at(points, reps)
    except Exception as e:  # noqa: BLE001 - report and fail: no number is better than a wrong one
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    what = "DeepSpeed ZeRO 1 (toy MLP, fp32)" if ds else "torch_native FSDP2"
    print(f"{what} PP2xDP2, SIGKILL of one rank (its shard lost) -> restore from the newest "
          f"complete checkpoint (every 10) -> the killed iteration committed again; median of {reps}; "
          f"load {' '.join(load)}")
    keys = list(next(iter(res.values())))
    print(f"  {'':28s} " + " ".join(f"{k:>12s}" for k in res))
    for k in keys:
        vals = [res[lbl][k] for lbl in res]
        print(f"  {k:28s} " + " ".join(f"{v:12.3f}" if isinstance(v, float) else f"{v:>12}" for v in vals))
    first, last = (res[f"at_{p}"]["kill_to_first_iteration_s"] for p in (points[0], points[-1]))
    print(f"  kill at {points[-1]} vs at {points[0]}: {last / first:.2f}x (target: within 20 %, no replay "
          f"from the start: {'met' if abs(last / first - 1) <= 0.2 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"restore_at": res, "config": {"quick": args.quick, "points": points, "loadavg": load,
                                                      "adapter": args.adapter}},
                      f, indent=2)
    return 0


def _mean_iteration_s(commits: list, warmup: int) -> float:
    """Seconds per iteration from the commit after the warm-up to the last one: a rate,
    not a median of gaps (the supervisor sees commits when it polls, sometimes two at
    once, and gaps of 0 and 2T make a median of gaps land on either)."""
    first: dict[int, float] = {}
    for c in sorted(commits, key=lambda c: c.t):
        first.setdefault(c.iteration, c.t)
    its = sorted(i for i in first if i >= warmup)
    if len(its) < 2:
        return math.nan
    return (first[its[-1]] - first[its[0]]) / (its[-1] - its[0])


def torch_native_fault_free(rounds: int, iterations: int, timeout: float = 300.0, job_name: str = "pp2dp2",
                            checkpoint_every: int = 0, baseline_tree: str | None = None) -> dict:
    """Fault-free iteration time, resilient vs stock path, PP2 x DP2 (the kill test's job):
    ``rounds`` rounds, each one run of the resilient path (its commit overlapped with the
    next iteration, the default), one of it with ``RESIHP_COMMIT_OVERLAP=0`` (each
    iteration committed before the next starts) and one of the stock path, in an order
    rotated every round. All come from peers.py (the same model, data and HSDP layout
    there): ``run_resihp`` is ``resihp run``'s production path without checkpoints,
    ``run_torchrun("plain")`` the stock script (``StockPipeline``) under torchrun. Per
    run: seconds per iteration from the commit after a warm-up of 3 to the last one (the
    supervisor's commits for ResiHP, rank 0's finished steps for stock); a ResiHP run
    whose detector re-planned without a fault (contention on a loaded host) is timed
    over its first plan.

    Next to the wall time, the CPU seconds per iteration of the job's workers (summed;
    :mod:`itercpu`), which move far less with the other sessions' load, and ResiHP's
    controller's and node agent's. ``job_name`` ``dp4`` (PP1 x DP4, issue 27) compares
    ResiHP with plain DDP and with ``plain-fsdp`` (the adapter's stock blocks) instead;
    ``checkpoint_every`` > 0 gives ResiHP that checkpoint interval (the peers' comparison
    with Young/Daly's). ``baseline_tree``: another checkout of ResiHP (e.g. the
    integration branch) whose workers run as one more system, ``resihp@base``, in the
    same rounds: an A/B of a change at the same load. A run that fails (a false node
    loss at high load) is recorded and its round's ratios left out, not the whole
    measurement."""
    from pathlib import Path

    import itercpu
    import peers

    job = peers.JOBS[job_name]
    root = Path(tempfile.mkdtemp(prefix="resihp-bench-ff-"))
    spec = peers.job_spec_json(job, iterations, root / "spec")
    systems: tuple[str, ...] = ("resihp", "resihp_sync", "stock") if job.pp > 1 else ("resihp", "plain", "plain-fsdp")
    base = "stock" if job.pp > 1 else "plain"
    if baseline_tree:
        systems += ("resihp@base",)
        tree = Path(baseline_tree).resolve()
        base_path = os.pathsep.join(str(tree / x) for x in ("", "adapters", "plugins"))
    runs: dict[str, list[float]] = {k: [] for k in systems}
    cpu: dict[str, list[dict]] = {k: [] for k in systems}
    loads = []
    failures: list[tuple[int, str, str]] = []
    replans: list[tuple[int, str, int, int]] = []  # (round, system, plan changes, iterations before the first)
    saved_env = dict(os.environ)
    itercpu.install(root)
    try:
        path0 = os.environ["PYTHONPATH"]
        for r in range(rounds):
            n = len(systems)
            for system in systems[r % n:] + systems[:r % n]:
                work = Path(tempfile.mkdtemp(prefix=f"{system.replace('@', '-')}-", dir=root))
                folder = itercpu.run_dir(root, f"{r}-{system.replace('@', '-')}")
                # the site first, then (for resihp@base) the other tree before this one
                site, _, rest = path0.partition(os.pathsep)
                os.environ["PYTHONPATH"] = (os.pathsep.join([site, base_path, rest]) if system == "resihp@base"
                                            else path0)
                if system.startswith("resihp"):
                    os.environ["RESIHP_COMMIT_OVERLAP"] = "0" if system == "resihp_sync" else "1"
                    run = peers.run_resihp(job, [], iterations, work, timeout, checkpoint_every=checkpoint_every)
                else:
                    kind = "plain" if system == "stock" else system
                    run = peers.run_torchrun(kind, job, [], iterations, work, spec, timeout, 0, 0)
                loads.append(os.getloadavg()[0])
                if not run.ok:
                    failures.append((r, system, run.error[:200]))
                    runs[system].append(math.nan)
                    cpu[system].append({})
                    print(f"  round {r + 1}: {system} failed: {run.error[:160]}", flush=True)
                    continue
                commits = run.commits
                resumes = run.extra.get("resumes", [])
                if resumes:
                    # A "fault-free" run that re-planned: on a loaded host the detector can
                    # take contention for a slow device and mitigate it. Time the first
                    # plan's iterations only (the overhead, not a different layout) and say so.
                    replans.append((r, system, len(resumes), resumes[0][0]))
                    commits = commits[:resumes[0][0]]
                runs[system].append(_mean_iteration_s(commits, warmup=3))
                c = itercpu.read(folder, warmup=3)
                if not system.startswith("resihp"):
                    c["other_cpu_s"] = math.nan  # the benchmark's own polling, not the system's
                cpu[system].append(c)
                print(f"  round {r + 1}: {system} {runs[system][-1]:.4f} s/it, workers' CPU "
                      f"{c.get('worker_cpu_s', math.nan):.4f} s/it, launcher/agent {c.get('parent_cpu_s', math.nan):.4f}, "
                      f"controller {c.get('other_cpu_s', math.nan):.4f}; load {loads[-1]:.1f}", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)

    def med(xs: list[float]) -> float:
        xs = [x for x in xs if not math.isnan(x)]
        return statistics.median(xs) if xs else math.nan

    def ratios(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))]

    def cpu_of(system: str, key: str) -> list[float]:
        return [c.get(key, math.nan) for c in cpu[system]]

    out = {"job": job_name, "systems": list(systems), "base": base, "checkpoint_every": checkpoint_every,
           "rounds": rounds, "iterations": iterations, "loadavg_1m": loads, "replans": replans,
           "failures": failures, "runs_s": runs, "cpu": cpu}
    for k in systems:
        out[f"{k}_iteration_s"] = med(runs[k])
        out[f"{k}_worker_cpu_s"] = med(cpu_of(k, "worker_cpu_s"))
        if k != base:
            rr = ratios(runs[k], runs[base])
            rc = ratios(cpu_of(k, "worker_cpu_s"), cpu_of(base, "worker_cpu_s"))
            out[f"{k}_per_round_ratio"], out[f"{k}_per_round_cpu_ratio"] = rr, rc
            out[f"{k}_vs_{base}"] = med(rr) - 1.0 if rr else math.nan
            out[f"{k}_cpu_vs_{base}"] = med(rc) - 1.0 if rc else math.nan
    if baseline_tree:  # the change itself: this tree's ResiHP over the other's, round by round
        rr = ratios(runs["resihp"], runs["resihp@base"])
        rc = ratios(cpu_of("resihp", "worker_cpu_s"), cpu_of("resihp@base", "worker_cpu_s"))
        out.update({"resihp_vs_base_per_round": rr, "resihp_vs_base_per_round_cpu": rc,
                    "resihp_vs_base": med(rr) - 1.0 if rr else math.nan,
                    "resihp_cpu_vs_base": med(rc) - 1.0 if rc else math.nan, "baseline_tree": str(baseline_tree)})
    if job.pp > 1:  # the names earlier results used
        out.update({"stock_runs_s": runs["stock"], "resihp_runs_s": runs["resihp"],
                    "resihp_sync_runs_s": runs["resihp_sync"],
                    "resihp_vs_stock": out["resihp_vs_stock"], "resihp_sync_vs_stock": out["resihp_sync_vs_stock"],
                    "per_round_ratio": out["resihp_per_round_ratio"],
                    "per_round_ratio_sync": out["resihp_sync_per_round_ratio"]})
    return out


_HF_STOCK_LINE = re.compile(r"rank=\d+ pid=\d+ iteration=(\d+) loss=")
_HF_COMMITTED_LINE = re.compile(r"^iteration\s+(\d+)\s+loss ")


def _stamped_lines(cmd: list[str], cwd: str, timeout: float) -> tuple[int, list[tuple[float, str]]]:
    """Run ``cmd`` in its own process group and stamp each output line as it arrives;
    on timeout kill that group (only what this started)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RESIHP_CONFIG", None)
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
    timer.start()
    lines = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append((time.perf_counter(), line.rstrip("\n")))
        rc = p.wait()
    finally:
        timer.cancel()
    return rc, lines


def hf_fault_free(rounds: int, iterations: int, timeout: float = 300.0) -> dict:
    """Fault-free iteration time of the user's HF LLaMA script (examples/hf_llama/train.py:
    AdamW, warm-up + cosine, clipping at 1.0, its own dataset; PP2 x DP2 HSDP as its
    resihp.toml says) run unchanged under ``accelerate launch`` (the stock path: torch's
    ``PipelineStage`` + ``Schedule1F1B`` + ``fully_shard``) and under ``resihp launch``
    (the resilient path), alternated every round, no checkpoints on either. Per run:
    seconds per iteration from the arrival of iteration ``warm-up`` to the last one, as
    printed (stock: the last stage's ranks; ResiHP: the controller's committed line)."""
    import shutil

    here = Path(__file__).resolve().parents[1] / "examples" / "hf_llama"
    bindir = Path(sys.executable).parent
    root = Path(tempfile.mkdtemp(prefix="resihp-bench-hf-ff-"))
    work = root / "script"
    work.mkdir()
    for f in ("accelerate.yaml", "train.py", "hf_model.py", "README.md"):
        shutil.copy(here / f, work / f)
    text = (here / "resihp.toml").read_text()
    text = re.sub(r"iterations = \d+", f"iterations = {iterations}", text)
    text = re.sub(r"checkpoint_every = \d+", "checkpoint_every = 0", text)
    (work / "resihp.toml").write_text(text)
    cmds = {"stock": [str(bindir / "accelerate"), "launch", "--config_file", "accelerate.yaml", "train.py",
                      "--iterations", str(iterations)],
            "resihp": [str(bindir / "resihp"), "launch", "--config_file", "accelerate.yaml", "--timeout",
                       str(int(timeout)), "train.py", "--iterations", str(iterations)]}
    warmup = 3
    runs: dict[str, list[float]] = {k: [] for k in cmds}
    loads: list[float] = []
    failures: list[tuple[int, str, str]] = []
    for r in range(rounds):
        order = list(cmds) if r % 2 == 0 else list(cmds)[::-1]
        for system in order:
            cmd = list(cmds[system])
            if system == "resihp":  # the launcher's options go before the script
                i = cmd.index("train.py")
                cmd[i:i] = ["--workdir", str(root / f"work-{r}")]
            rc, lines = _stamped_lines(cmd, str(work), timeout)
            loads.append(os.getloadavg()[0])
            pattern = _HF_STOCK_LINE if system == "stock" else _HF_COMMITTED_LINE
            first: dict[int, float] = {}
            for t, line in lines:
                m = pattern.search(line)
                if m:
                    first.setdefault(int(m.group(1)), t)
            its = sorted(i for i in first if i >= warmup)
            if rc != 0 or len(its) < 2:
                failures.append((r, system, f"rc {rc}: " + " | ".join(x for _, x in lines[-3:])))
                runs[system].append(math.nan)
                print(f"  round {r + 1}: {system} failed (rc {rc})", flush=True)
                continue
            runs[system].append((first[its[-1]] - first[its[0]]) / (its[-1] - its[0]))
            print(f"  round {r + 1}: {system} {runs[system][-1]:.4f} s/it; load {loads[-1]:.1f}", flush=True)
    ratios = [a / b for a, b in zip(runs["resihp"], runs["stock"]) if not (math.isnan(a) or math.isnan(b))]
    med = {k: statistics.median([x for x in v if not math.isnan(x)] or [math.nan]) for k, v in runs.items()}
    return {"job": "hf_llama pp2dp2", "rounds": rounds, "iterations": iterations, "warmup": warmup,
            "runs_s": runs, "per_round_ratio": ratios, "loadavg_1m": loads, "failures": failures,
            "stock_iteration_s": med["stock"], "resihp_iteration_s": med["resihp"],
            "resihp_vs_stock": statistics.median(ratios) - 1.0 if ratios else math.nan}


def print_hf_fault_free(ff: dict) -> None:
    loads = ff["loadavg_1m"]
    print(f"torch_native fault-free, the user's HF LLaMA script (examples/hf_llama, PP2 x DP2, 4 CPU workers), "
          f"{ff['rounds']} rounds alternated, {ff['iterations']} iterations each, no checkpoints; load (1 min) "
          f"{min(loads):.1f}-{max(loads):.1f}; seconds per iteration after a warm-up of {ff['warmup']}")
    for k in ("stock", "resihp"):
        print(f"  {k:8s} {ff[k + '_iteration_s']:8.4f}   " + " ".join(f"{x:.4f}" for x in ff["runs_s"][k]))
    print(f"  resihp vs stock: wall {100 * ff['resihp_vs_stock']:+.1f} % (per round "
          + " ".join(f"{100 * (x - 1):+.1f}" for x in ff["per_round_ratio"]) + ")")
    print(f"  target within 3 %: {'met' if ff['resihp_vs_stock'] <= 0.03 else 'NOT met'}")
    for r, system, err in ff["failures"]:
        print(f"  round {r + 1}: {system} FAILED ({err[:160]}); that round's ratio left out")


# Started in every worker (ResiHP's: RESIHP_JOB and RESIHP_DEVICE set; torchrun's: RANK)
# through a sitecustomize on the workers' PYTHONPATH: wall time and calls of each part of
# an iteration, per process, written at exit (``--fault-free-phases``).
_PHASES_SITE = 'import os\n_DIR = os.environ.get("RESIHP_PHASES_DIR")\n_ROLE = ("resihp" if os.environ.get("RESIHP_DEVICE") and os.environ.get("RESIHP_JOB")\n         else "stock" if os.environ.get("RANK") and os.environ.get("LOCAL_RANK") else None)\nif _DIR and _ROLE:\n    import atexit, importlib, json, time, functools\n    _acc = {}\n    def _wrap(owner, attr, key):\n        fn = getattr(owner, attr)\n        @functools.wraps(fn)\n        def run(*a, **k):\n            t = time.perf_counter()\n            try:\n                return fn(*a, **k)\n            finally:\n                s = _acc.setdefault(key, [0.0, 0])\n                s[0] += time.perf_counter() - t\n                s[1] += 1\n        setattr(owner, attr, run)\n    def _install():\n        targets = [\n            ("torch.distributed.pipelining.schedules", "_PipelineScheduleRuntime", "_step_microbatches", "schedule(runtime)"),\n            ("torch.distributed.pipelining.schedules", "PipelineScheduleSingle", "step", "schedule.step(stock)"),\n            ("torch.distributed.pipelining.stage", "_PipelineStageBase", "forward_one_chunk", "fwd chunk"),\n            ("torch.distributed.pipelining.stage", "_PipelineStageBase", "backward_one_chunk", "bwd chunk"),\n            ("torch.distributed.pipelining.stage", "_PipelineStageBase", "perform_reduce_grad", "reduce grad"),\n            ("torch.optim.adamw", "AdamW", "step", "optimizer step"),\n        ]\n        if _ROLE == "resihp":\n            targets += [\n                ("resihp_core.runtime.session", None, "put_report", "put_report"),\n                ("resihp_core.runtime.session", None, "commit", "commit"),\n                ("resihp_adapters.torch_native.engine", "TorchNativeEngine", "run", "engine.run"),\n                ("resihp_adapters.torch_native.engine", "TorchNativeEngine", "snapshot", "snapshot"),\n                ("resihp_adapters.torch_native.engine", "TorchNativeEngine", "finish_grads", "finish_grads"),\n                ("resihp_adapters.torch_native.engine", "TorchNativeEngine", "_prepare", "_prepare"),\n                ("resihp_adapters.torch_native.adapter", "TorchNativeAdapter", "profile", "adapter.profile"),\n                ("resihp_adapters.torch_native.adapter", "TorchNativeAdapter", "result_of", "result_of"),\n                ("resihp_core.adapter", "AdapterContext", "step", "ctx.step (beat, abort check)"),\n                ("resihp_core.runtime.heartbeat", "WorkerClient", "send_profile", "send_profile"),\n            ]\n        else:\n            targets += [("resihp_adapters.torch_native.reference", "StockPipeline", "step", "iteration (stock)")]\n        for mod, cls, attr, key in targets:\n            try:\n                m = importlib.import_module(mod)\n                owner = getattr(m, cls) if cls else m\n                _wrap(owner, attr, key)\n            except Exception as e:  # noqa\n                _acc.setdefault("ERR " + key + ": " + repr(e)[:80], [0.0, 0])\n    _install()\n    def _dump():\n        with open(os.path.join(_DIR, f"{_ROLE}-{os.environ.get(\'RESIHP_DEVICE\') or os.environ.get(\'RANK\')}-{os.getpid()}.json"), "w") as f:\n            json.dump(_acc, f)\n    atexit.register(_dump)\n'


def torch_native_fault_free_phases(iterations: int, timeout: float = 300.0) -> dict:
    """Where a fault-free PP2 x DP2 iteration goes, resilient (commit overlapped, and in
    line) vs stock: one run each of the fault-free comparison's jobs with every worker's
    parts timed (wall clock, ms per iteration per worker, by device), and the CPU
    seconds of the job's processes by role. One run each, not alternated rounds: read
    the ResiHP-only parts (snapshot, report, commit, per-chunk hooks) against the parts
    both pay, not the totals, on a loaded host."""
    import glob
    from pathlib import Path

    import peers
    from fault_free_profile import CpuSampler

    root = Path(tempfile.mkdtemp(prefix="resihp-bench-phases-"))
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_PHASES_SITE)
    job = peers.JOBS["pp2dp2"]
    spec = peers.job_spec_json(job, iterations, root / "spec")
    env0 = dict(os.environ)
    out: dict = {}
    try:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env0.get("PYTHONPATH")]))
        for system in ("resihp", "resihp_sync", "stock"):
            d = root / system
            (d / "work").mkdir(parents=True)
            os.environ["RESIHP_PHASES_DIR"] = str(d)
            os.environ["RESIHP_COMMIT_OVERLAP"] = "0" if system == "resihp_sync" else "1"
            cpu, load0 = CpuSampler(), os.getloadavg()[0]
            if system == "stock":
                run = peers.run_torchrun("plain", job, [], iterations, d / "work", spec, timeout, 0, 0)
            else:
                run = peers.run_resihp(job, [], iterations, d / "work", timeout, checkpoint_every=0)
            if not run.ok:
                raise RuntimeError(f"{system} run failed: {run.error}")
            parts: dict[str, list[float]] = {}
            for f in sorted(glob.glob(str(d / "*.json"))):
                for k, (sec, _calls) in json.load(open(f)).items():
                    parts.setdefault(k, []).append(1e3 * sec / iterations)
            out[system] = {"iteration_s": _mean_iteration_s(run.commits, 3), "load": [load0, os.getloadavg()[0]],
                           "cpu_s": cpu.roles(), "parts_ms": parts, "replans": len(run.extra.get("resumes", []))}
    finally:
        os.environ.clear()
        os.environ.update(env0)
    return out


def migration_vs_bytes(quick: bool) -> list[dict]:
    hidden = 128 if quick else 256
    js = spec(dp=1, m=2, hidden=hidden, ffn=hidden * 2, layers=8, vocab=256, tokens=64)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=8, num_microbatches=2, num_heads=4)
    out = []
    with LocalJob(js.to_json(), plan.devices()) as job:
        job.post(plan, iterations=10_000)
        job.wait(1, timeout=120)
        current = plan
        for counts in ([5, 3], [7, 1], [4, 4], [1, 7]):
            nxt = current.with_(layer_ranges=ranges_from_counts(counts))
            moved_layers = sum(
                1 for i in range(8)
                if _stage_of(current, i) != _stage_of(nxt, i)
            )
            resume = job.abort()
            job.post(nxt, iterations=10_000, resume=resume)
            job.wait(resume + 1, timeout=120)
            info = job.ready_info()
            out.append(dict(layers_moved=moved_layers,
                            bytes_moved=sum(v["bytes_received"] for v in info.values()),
                            state_s=max(v["state_s"] for v in info.values()),
                            rebuild_s=max(v["rebuild_s"] for v in info.values())))
            current = nxt
    return out


def _stage_of(plan: ParallelPlan, layer: int) -> int:
    return next(s for s, (a, b) in enumerate(plan.layer_ranges) if a <= layer < b)


def predictor_mape(quick: bool) -> dict:
    """Iteration-time MAPE on held-out iterations. The job is run ``reps`` times (the data
    of iteration ``i`` is the same in every run), so every iteration's measured time is a
    median with a standard error: the noise floor the MAPE is judged against."""
    warm, held, reps = (3, 12, 3) if quick else (4, 24, 5)
    m = 6
    js = spec(dp=1, m=m, hidden=128, ffn=256, layers=4, vocab=256, tokens=512, heads=4, scale=64.0)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=m, num_heads=4)
    skip = 2  # iterations 0-1 warm allocators and caches (slower than any later one): dropped
    total = skip + warm + held
    runs = []
    for _ in range(reps):
        with LocalJob(js.to_json(), plan.devices()) as job:
            job.post(plan, iterations=total)
            job.wait(total, timeout=300)
            runs.append({i: job.report(i) for i in range(total)})
    from resihp_adapters.megatron_ref.adapter import data_spec

    data = data_spec(js)
    stages = []
    for s in range(plan.pp):
        dev = plan.group(0, s)[0]
        samples = [
            (lengths_of(data, i, mb.owner, mb.mb), mb.forward_s, mb.backward_s)
            for reports in runs
            for i in range(skip, skip + warm)
            for mb in reports[i][dev].microbatches
        ]
        stages.append(fit_stage(samples, ref_layers=plan.layers(s), ref_tp=1))
    topo = Topology.uniform(1, plan.pp)
    pred = IterationPredictor(CostModel(tuple(stages)), topo,
                              ModelShape(tokens=512, hidden=128, params_per_layer=1, dtype_bytes=4),
                              LinkModel(intra_bandwidth=2e9, intra_latency=50e-6))

    def per_run(i):
        return [max(r.iteration_s for r in reports[i].values()) for reports in runs]

    def measured(i):
        return statistics.median(per_run(i))

    def predicted(i):
        wl = {(0, j): lengths_of(data, i, 0, j) for j in range(m)}
        return pred.predict(plan, wl).iteration_time

    # Per-iteration fixed costs (loss bookkeeping, optimizer, store) from the warm-up
    # (median over its iterations and runs: one slow spell must not shift every prediction).
    overhead = statistics.median(x - predicted(i) for i in range(skip, skip + warm) for x in per_run(i))
    held_its = range(skip + warm, total)
    meas = [measured(i) for i in held_its]
    preds = [predicted(i) + overhead for i in held_its]
    # Relative standard error of each held-out median (MAD-based, as in predictor_accuracy).
    se = [1.2533 * 1.4826 * statistics.median(abs(x - measured(i)) for x in per_run(i)) / reps ** 0.5
          / measured(i) for i in held_its]
    rms = (sum(x * x for x in se) / len(se)) ** 0.5
    floor = 100 * (2 / math.pi) ** 0.5 * rms
    err = mape(preds, meas)
    return dict(iteration_mape_pct=err, mape_floor_pct=floor, mape_beyond_floor_pct=floor_corrected(err, floor),
                heldout_se_rms_pct=100 * rms, held_out_iterations=len(meas), runs=reps,
                warmup_iterations=warm, overhead_s=overhead,
                measured_mean_s=statistics.mean(meas), predicted_mean_s=statistics.mean(preds))


# ---------------------------------------------------------------- DeepSpeed adapter
DS_TOY = {"model": "resihp_adapters.deepspeed.toy:build", "hidden": 64, "num_layers": 6,
          "micro_batch_size": 4, "dtype": "float32"}


def _ds_kill_plans() -> tuple[ParallelPlan, int, ParallelPlan]:
    """PP2 x DP2 of the toy, the victim (replica 1's stage 1) and the plan the Scheduler
    makes for its fail-stop, asked as ``resihp launch`` assembles a DeepSpeed job (its
    planner and prior): replica 1 keeps stage 0 and its stage-1 work runs on replica 0,
    with the layers re-split so that the stage running 8 micro-batches holds fewer of
    them (6 layers: 0-4 | 4-6). With ZeRO 0 (fp32) the adapter runs that plan as it is
    (3 busy survivors); with ZeRO 1 as its whole-replica equivalent (docs/deepspeed.md,
    partial replicas)."""
    from pathlib import Path

    from resihp_core.protocol.messages import FailureReport
    from resihp_adapters.deepspeed.launch import assemble_launch

    job = assemble_launch(4, {"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 4},
                          {"num_layers": 6, "iterations": 1000, "pp": 2}, Path(tempfile.mkdtemp(prefix="resihp-ds-plan-")))
    plan = job.plan
    victim = plan.group(1, 1)[0]
    after = job.planner.plan(job.state, FailureReport(generation=0, failure="fail-stop", devices=(victim,))).plan
    if set(after.devices()) != set(plan.devices()) - {victim}:
        raise RuntimeError(f"the Scheduler's plan for the kill does not keep the 3 survivors busy:\n{after.to_text()}")
    return plan, victim, after


def ds_kill_to_iteration(reps: int, timeout_s: float, after: int = 6, static: dict | None = None) -> dict:
    """ZeRO 0: kill -> first committed iteration (state from memory), median and max;
    the post-failure iteration time (median of ``after`` iterations); with ``static`` (a
    dict that receives the plan's description) each repetition is followed by a fresh
    run of the best static 3-device plan (:func:`ds_static_three`), and the ratio of the
    two is per repetition."""
    rows = []
    for rep in range(reps):
        js = JobSpec(adapter="deepspeed", adapter_config=DS_TOY, dp=2, num_microbatches=4, timeout_s=timeout_s)
        plan, victim, partial = _ds_kill_plans()
        work = tempfile.mkdtemp(prefix="resihp-ds-kill-")
        with LocalJob(js.to_json(), plan.devices(), workdir=work) as job:
            pids = {d: job.processes.procs[d].pid for d in plan.devices()}  # started with the job
            row = timed_kill(job, plan, victim, partial, timeout=300)
            before = [max(r.iteration_s for r in job.report(i).values()) for i in (1, 2)]
            # The post-failure steady state, measured as the static plan's is (below):
            # after 3 more iterations, the median of the next ``after``.
            first = row["killed_at"] + 3
            job.wait(first + after + 1, timeout=300)
            post = [max(r.iteration_s for r in job.report(i).values()) for i in range(first, first + after)]
            same = all(job.processes.procs[d].pid == p for d, p in pids.items() if d in partial.devices())
        rows.append(row | {"iteration_before_s": statistics.median(before), "survivors_kept_pid": float(same),
                           "post_failure_iteration_s": statistics.median(post)})
        if static is not None:  # the best static 3-device plan, fresh, right after (same load)
            st = ds_static_three(after)
            rows[-1] |= {"static_iteration_s": st["static_iteration_s"],
                         "post_failure_vs_static": rows[-1]["post_failure_iteration_s"] / st["static_iteration_s"]}
            static.update(static_plan=st["static_plan"])
        print(f"  kill run {rep + 1}: {rows[-1]['kill_to_first_iteration_s']:.3f} s"
              + (f"; post-failure / static {rows[-1]['post_failure_vs_static']:.2f}" if static is not None else ""),
              flush=True)
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    if static is not None:
        out["post_failure_vs_static_runs"] = [round(r["post_failure_vs_static"], 3) for r in rows]
    out["kill_to_first_iteration_max_s"] = max(r["kill_to_first_iteration_s"] for r in rows)
    out["kill_to_first_iteration_runs_s"] = [round(r["kill_to_first_iteration_s"], 3) for r in rows]
    return out | {"repetitions": reps, "op_timeout_s": timeout_s}


def ds_static_three(iterations: int = 8, warm: int = 3) -> dict:
    """The best static plan for the kill's 3 survivors, run fresh and fault-free (same
    toy model, job and global batch): PP3 x DP1, layers (2, 2, 2), all 8 micro-batches on
    the one replica. It is the only static (whole-replica, uniform) 3-device layout of
    this job: DP3 cannot split its 8 micro-batches evenly, and with the prior's equal
    per-layer costs the Scheduler cuts 6 layers into 3 stages evenly. Median over the
    iterations after ``warm`` of the slowest rank's iteration time."""
    js = JobSpec(adapter="deepspeed", adapter_config=DS_TOY, dp=2, num_microbatches=4, timeout_s=10.0)
    _, victim, partial = _ds_kill_plans()
    survivors = sorted(partial.devices())
    static = ParallelPlan.uniform(tp=1, pp=3, dp=1, num_layers=6, num_microbatches=8, devices=survivors)
    with LocalJob(js.to_json(), static.devices(), workdir=tempfile.mkdtemp(prefix="resihp-ds-static-")) as job:
        job.post(static, iterations=max(1000, warm + iterations + 2))
        job.wait(warm + iterations + 1, timeout=600)
        times = [max(r.iteration_s for r in job.report(i).values()) for i in range(warm, warm + iterations)]
    return {"static_plan": f"PP3 x DP1 on devices {survivors}, stages {list(static.layer_ranges)}",
            "static_iteration_s": statistics.median(times), "static_iterations": len(times)}


def ds_restore_at(points: list[int], reps: int, every: int = 10) -> dict:
    """ZeRO 1 (the killed rank takes its optimizer shard): kill -> the killed iteration
    committed again through a restore from the checkpoint the supervisor's rule picks
    (every ``every``), after ``points`` iterations of the same job."""
    return _restore_at(points, reps, every, _ds_kill_plans(), lambda ckpt: JobSpec(
        adapter="deepspeed", adapter_config={**DS_TOY, "zero_stage": 1}, dp=2, num_microbatches=4, timeout_s=10.0,
        checkpoint_dir=ckpt, checkpoint_every=every, checkpoint_keep=2), timeout=900)


def _ds_iteration_worker(store: str, out: str, iters: int, blocks: int) -> None:
    """One rank: DeepSpeed's stock PipelineEngine and ResiHP's engine built side by side
    in one world (same model and data), stepped alternately, so load drift on a shared
    machine hits both alike. ``blocks`` is unused (kept for the command line)."""
    import deepspeed
    import torch
    import torch.distributed as tdist
    from datetime import timedelta

    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from resihp_core.predictor.schedules import emit_programs
    from resihp_adapters.deepspeed import toy
    from resihp_adapters.deepspeed.data import MicroBatchSource
    from resihp_adapters.deepspeed.engine import plan_topology
    from resihp_adapters.deepspeed.world import bound_op_timeouts, build_engine, ds_config_for, init_world, prepare_deepspeed

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = store.rsplit(":", 1)
    st = tdist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))
    prepare_deepspeed(60)
    js = JobSpec(adapter="deepspeed", dp=2, num_microbatches=8)
    spec = toy.build(DS_TOY, js)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=6, num_microbatches=8)
    init_world(st, 0, rank, world, 60)
    module = PipelineModule(spec.layers, topology=PipeDataParallelTopology(2, 2), loss_fn=spec.loss_fn,
                            seed_layers=True, base_seed=7, partition_method="uniform")
    stock, *_ = deepspeed.initialize(model=module, optimizer=spec.optimizer(list(module.parameters())),
                                     config=dict(spec.config))
    src = MicroBatchSource(spec.dataset, MicroBatchSource.default_collate, 4, 8, 2)
    it = src.iterator(stock.grid.data_parallel_id)
    ours = build_engine(spec.layers, parts=[0, 3, 6], topology=plan_topology(plan),
                        config=ds_config_for(spec.config, micro_batch_size=4, num_microbatches=8, replicas=2),
                        optimizer=spec.optimizer, loss_fn=spec.loss_fn, base_seed=7)
    bound_op_timeouts(60)
    ours.set_work(plan, {(p.replica, p.stage): p for p in emit_programs(plan)}[plan.location(rank)[:2]], src)
    steps = {"stock": functools.partial(stock.train_batch, it), "resihp": ours.train_batch}
    times: dict[str, list[float]] = {"stock": [], "resihp": []}
    for n in range(iters + 2):
        for kind in (("stock", "resihp") if n % 2 == 0 else ("resihp", "stock")):
            tdist.barrier()
            t0 = time.perf_counter()
            steps[kind]()
            if n >= 2:  # two warm-up iterations each
                times[kind].append(time.perf_counter() - t0)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(times, f)
    # Both engines and the world go while the interpreter is whole: gloo threads left to
    # interpreter shutdown can abort the finished rank (docs/deepspeed.md, "Exit").
    from resihp_adapters.deepspeed.world import dismantle, teardown_world

    del steps, it
    dismantle(stock)
    dismantle(ours)
    del stock, ours
    teardown_world()


def ds_engine_overhead(iters: int, blocks: int) -> dict:
    import subprocess
    from datetime import timedelta

    import torch.distributed as tdist

    out = tempfile.mkdtemp(prefix="resihp-ds-bench-")
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    procs = []
    try:
        for r in range(4):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="4", LOCAL_RANK="0", OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, os.environ.get("RESIHP_BENCH_WORKER", __file__), "--_ds-worker", f"127.0.0.1:{store.port}", out,
                                           str(iters), str(blocks)], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        rc = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if rc != [0] * 4:
        raise RuntimeError(f"DeepSpeed benchmark workers exited with {rc}")
    per = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]
    # An iteration takes as long as its slowest rank.
    stock = [max(p["stock"][i] for p in per) for i in range(len(per[0]["stock"]))]
    ours = [max(p["resihp"][i] for p in per) for i in range(len(per[0]["resihp"]))]
    ms, mo = statistics.median(stock), statistics.median(ours)
    return {"stock_iteration_s": ms, "resihp_iteration_s": mo, "resihp_vs_stock": mo / ms - 1.0,
            "iterations_each": len(stock)}


def main_deepspeed(args) -> int:
    reps = args.kills or (1 if args.quick else 5)
    load = open("/proc/loadavg").read().split()[:3]
    # The job's op timeout: a peer that waited it out would show as a >= 10 s outlier
    # (3 s made the first iteration's receives time out on a machine at load 27).
    # The post-failure iteration time against the best static plan for 3 devices, run
    # fresh after each kill repetition in the same benchmark run (issue 25).
    static: dict = {}
    kill = ds_kill_to_iteration(reps, timeout_s=10.0, after=4 if args.quick else 6, static=static)
    over = {} if args.kill_only else ds_engine_overhead(10 if args.quick else 40, 1)
    load_end = open("/proc/loadavg").read().split()[:3]
    print(f"DeepSpeed adapter, 4 gloo workers PP2 x DP2, ZeRO 0 fp32, device 3 SIGKILLed -> the 3 survivors "
          f"(partial replica kept busy); median of {reps} (load average {' '.join(load)} at start, "
          f"{' '.join(load_end)} at end)")
    print(f"{'metric':<40}{'value':>12}")
    for k, v in {**{f"kill_{k}": v for k, v in kill.items()}, **static, **over}.items():
        print(f"{k:<40}{v:>12.4f}" if isinstance(v, float) else f"{k:<40}{v!s:>12}")
    worst = kill["kill_to_first_iteration_max_s"]
    print(f"  max kill -> first iteration <= 2 s (no op-timeout wait): {'met' if worst <= 2 else 'NOT met'}")
    print(f"  post-failure iteration (3 survivors, partial replica kept busy) / best static 3-device plan "
          f"({static['static_plan']}, fresh, fault-free, after each kill run): median "
          f"{kill['post_failure_vs_static']:.2f}x of {kill['post_failure_vs_static_runs']} "
          f"({kill['post_failure_iteration_s']:.4f} s vs {kill['static_iteration_s']:.4f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{f"kill_{k}": v for k, v in kill.items()}, **static, **over, "loadavg": load, "loadavg_end": load_end,
                       "config": {"adapter": "deepspeed", "quick": args.quick, **DS_TOY}}, f, indent=2)
    return 0


_RESTART_CONFIG = """
[parallel]
tp = 1
pp = 2
dp = 2
[model]
layers = 4
hidden = 32
heads = 4
vocab = 64
ffn_hidden = 64
[training]
microbatches = 2
token_budget = 64
iterations = 20
dtype = "float64"
checkpoint_every = 4
[runtime]
nodes = 2
devices_per_node = 2
controller_grace_s = 60
[detector]
heartbeat_interval_s = 0.1
heartbeat_miss_limit = 8
hang_min_timeout_s = 20.0
"""


class _Lines:
    """A process's output lines with the monotonic time each arrived."""

    def __init__(self, proc) -> None:
        import threading

        self.proc, self.lines = proc, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait(self, pattern: str, timeout: float):
        import re

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return t, m
            if self.proc.poll() is not None:
                break
            time.sleep(0.005)
        raise RuntimeError(f"no line matching {pattern!r}; output:\n" + "".join(l for _, l in self.lines)[-3000:])


def controller_restart(reps: int, grace_s: float = 60.0) -> dict:
    """SIGKILL the controller at iteration 8, restart it at once with ``--resume``
    (``grace_s = 0``: nothing outlives it, the restart restores from a checkpoint)."""
    import subprocess

    cli = [sys.executable, "-m", "resihp_core.cli", "run"]
    rows = []
    for _ in range(reps):
        tmp = tempfile.mkdtemp(prefix="resihp-ctl-restart-")
        cfg = os.path.join(tmp, "job.toml")
        with open(cfg, "w") as f:
            f.write(_RESTART_CONFIG.replace("controller_grace_s = 60", f"controller_grace_s = {grace_s:g}"))
        args = [*cli, cfg, "--no-live", "--report", os.path.join(tmp, "reports"), "--workdir", os.path.join(tmp, "w")]
        first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _Lines(first).wait(r"^iteration\s+([89]|1\d)\s+loss", 300)
        first.kill()
        first.wait(10)
        killed = time.monotonic()
        second = subprocess.Popen([*args, "--resume"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = _Lines(second)
        attached, _ = out.wait(r"attach: controller restarted" if grace_s > 0 else r"plan: generation 0", 300)
        committed, m = out.wait(r"^iteration\s+(\d+)\s+loss", 300)
        if second.wait(300) != 0:
            raise RuntimeError("the resumed run failed:\n" + "".join(l for _, l in out.lines)[-3000:])
        if grace_s > 0 and "from the checkpoint" in "".join(l for _, l in out.lines):
            raise RuntimeError("the restart restored from a checkpoint instead of re-attaching")
        rows.append({"restart_to_reattached_s": attached - killed, "restart_to_first_commit_s": committed - killed,
                     "reattached_to_first_commit_s": committed - attached,
                     "first_iteration_after_restart": int(m.group(1))})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"runs": len(rows)}


def _main_controller_restart(args) -> int:
    reps = 1 if args.quick else 3
    try:
        res = {"re-attach": controller_restart(reps, 60.0), "restore (grace 0)": controller_restart(reps, 0.0)}
    except Exception as e:  # noqa: BLE001 - report and fail: no number is better than a wrong one
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    print(f"controller SIGKILL at iteration 8 of 20, restarted at once with --resume "
          f"(TP1xPP2xDP2, checkpoint every 4; median of {reps}; load {' '.join(load)})")
    print("  (restore: 'reattached' is the first plan generation posted; the job restarts every process)")
    print(f"  {'':32s} " + " ".join(f"{k:>18s}" for k in res))
    for k in res["re-attach"]:
        vals = [r[k] for r in res.values()]
        print(f"  {k:32s} " + " ".join(f"{v:18.3f}" if isinstance(v, float) else f"{v!s:>18}" for v in vals))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{f"{lbl}_{k}": v for lbl, r in res.items() for k, v in r.items()},
                       "config": {"quick": args.quick, "loadavg": load}}, f, indent=2)
    return 0


def _hf_env() -> dict:
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_llama")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


def torch_native_tp_kill(reps: int) -> dict:
    """torch_native with tensor parallelism: the user's tiny HF LLaMA (examples/hf_llama,
    float64), TP2 x PP2 x DP1; SIGKILL of device 3 (stage 1's TP group) -> first
    committed iteration with stage 1 at TP1 and stage 0 still at TP2, the state moved
    from the survivors' memory (each TP rank keeps its whole stage, docs/torch_native.md)."""
    base = ParallelPlan(num_layers=4, layer_ranges=((0, 2), (2, 4)), tp_groups=(((0, 1), (2, 3)),),
                        num_microbatches=4)
    victim = 3
    after = base.with_(tp_groups=(((0, 1), (2,)),), excluded=frozenset([victim]))
    rows = []
    for _ in range(reps):
        js = JobSpec(adapter="torch_native", adapter_config={"user": "hf_model:user_llama"},
                     data={"source": "synthetic", "token_budget": 64}, dp=1, num_microbatches=4, timeout_s=10.0)
        with LocalJob(js.to_json(), base.devices(), env=_hf_env()) as job:
            row = timed_kill(job, base, victim, after, timeout=180)
            before = [max(r.iteration_s for r in job.report(i).values()) for i in (1, 2)]
        rows.append(row | {"iteration_before_s": statistics.median(before)})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"repetitions": reps}


def _tp_iteration_worker(port: str, out: str, blocks: int, per_block: int) -> None:
    """One rank of the fault-free comparison: the resilient engine's TP path (TPEngine,
    lowered core programs, TPStage peers) and stock torch (parallelize_module +
    PipelineStage + Schedule1F1B), TP2 x PP2, in alternating blocks in the same
    processes (a new world per block), so load drift hits both alike. Each iteration's
    time is the slowest rank's; the first of each block (metadata inference) is left out."""
    import torch
    import torch.distributed as tdist
    from datetime import timedelta

    from hf_model import user_llama
    from resihp_core.predictor.schedules import emit_programs
    from resihp_adapters.torch_native.reference import StockPipeline
    from resihp_adapters.torch_native.tp import TPEngine

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    st = tdist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=timedelta(seconds=300))
    plan = ParallelPlan(num_layers=4, layer_ranges=((0, 2), (2, 4)), tp_groups=(((0, 1), (2, 3)),),
                        num_microbatches=4)
    times: dict[str, list[float]] = {"resilient": [], "stock": []}

    def slowest(t: float) -> float:
        x = torch.tensor([t], dtype=torch.float64)
        tdist.all_reduce(x, op=tdist.ReduceOp.MAX)
        return float(x)

    for b in range(blocks):
        user = user_llama()
        eng = TPEngine(rank, user.stages, user.data(4), tdist.PrefixStore(f"eng{b}/", st), recipe=user.recipe,
                       timeout_s=60.0)
        eng.rebuild(plan, 0)
        eng.start_fresh()
        prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(0, eng.place.stage)]
        for i in range(per_block):
            t0 = time.perf_counter()
            eng.run(prog)
            dt = slowest(time.perf_counter() - t0)
            if i:
                times["resilient"].append(dt)
        eng.release()
        user = user_llama()
        tdist.init_process_group("gloo", store=tdist.PrefixStore(f"stock{b}/", st), rank=rank, world_size=4,
                                 timeout=timedelta(seconds=60))
        stock = StockPipeline(user.stages, user.data(4), pp=2, num_microbatches=4, recipe=user.recipe, tp=2)
        for i in range(per_block):
            t0 = time.perf_counter()
            stock.step()
            dt = slowest(time.perf_counter() - t0)
            if i:
                times["stock"].append(dt)
        tdist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def torch_native_tp_overhead(blocks: int, per_block: int) -> dict:
    """Fault-free iteration time, the resilient TP path against stock torch (see
    :func:`_tp_iteration_worker`), 4 processes."""
    import subprocess
    from datetime import timedelta

    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    out = tempfile.mktemp(suffix=".json")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_tp-worker", str(store.port), out,
                               str(blocks), str(per_block)], env={**_hf_env(), "RANK": str(r), "OMP_NUM_THREADS": "1"})
             for r in range(4)]
    try:
        for p in procs:
            p.wait(timeout=900)
    finally:
        for p in procs:  # by pid, only what this benchmark started
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"TP iteration workers exited with {[p.returncode for p in procs]}")
    with open(out) as f:
        times = json.load(f)
    res, stock = statistics.median(times["resilient"]), statistics.median(times["stock"])
    return {"resilient_iteration_s": res, "stock_iteration_s": stock, "overhead_pct": 100 * (res / stock - 1),
            "iterations_each": len(times["stock"])}


def _main_torch_native_tp(args) -> int:
    try:
        kill = torch_native_tp_kill(1 if args.quick else 3)
        cost = torch_native_tp_overhead(2 if args.quick else 4, 4 if args.quick else 6)
    except Exception as e:  # noqa: BLE001 - report and fail: no number is better than a wrong one
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    print(f"torch_native TP (hf_llama, float64): SIGKILL of device 3, TP2xPP2 -> stage 0 TP2, stage 1 TP1 "
          f"(median; load {' '.join(load)})")
    for k, v in {**kill, **cost}.items():
        print(f"  {k:28s} {v:12.3f}" if isinstance(v, float) else f"  {k:28s} {v!s:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{f"kill_{k}": v for k, v in kill.items()}, **cost,
                       "config": {"quick": args.quick, "adapter": "torch_native", "tp": 2, "loadavg": load}}, f,
                      indent=2)
    return 0


# ---------------------------------------------------------------- Megatron-Core adapter
def _main_megatron_core(args) -> int:
    """``--adapter megatron_core``: SIGKILL of one TP member of a TP2 x PP2 x DP2 job (8
    workers, the built-in GPTModel job in float32, Megatron's optimizer with clipping and
    its scheduler) -> first committed iteration. Megatron-Core's parallel state has one TP
    size, so the lost member's replica drops out and its micro-batches run whole on the
    other replica (``uneven_dp``), the state coming from that replica in memory (``--quick``:
    one repetition instead of 3). ``--distributed-optimizer``: Megatron's distributed
    optimizer, whose Adam shards the adapter gathers after every step, so the surviving
    replica holds the dropped one's moments."""
    from resihp_core.testing.conformance import _drop_replica

    tp, reps = 2, 1 if args.quick else 3
    dopt = bool(args.distributed_optimizer)
    rows = []
    for _ in range(reps):
        js = JobSpec(adapter="megatron_core", adapter_config={"distributed_optimizer": dopt} if dopt else {},
                     data={"source": "synthetic"}, dp=2,
                     num_microbatches=4, timeout_s=10.0)
        plan = ParallelPlan.uniform(tp=tp, pp=2, dp=2, num_layers=4, num_microbatches=4)
        victim = plan.group(1, 1)[-1]
        after = _drop_replica(plan, 1)  # the victim's replica leaves; its peers idle
        with LocalJob(js.to_json(), plan.devices()) as job:
            rows.append(timed_kill(job, plan, victim, after, timeout=600))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"megatron_core: SIGKILL of device {victim} (TP{tp} x PP2 x DP2, {len(plan.devices())} CPU workers), "
          f"replica 1 dropped, state from replica 0 in memory{', distributed optimizer' if dopt else ''} "
          f"(median of {reps})")
    for k, v in med.items():
        print(f"  {k:28s} {v:10.3f}" if isinstance(v, float) else f"  {k:28s} {v!s:>10}")
    load = os.getloadavg()
    print(f"  load average {load[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kill": med, "rows": rows, "loadavg": load, "config": {"adapter": "megatron_core", "tp": tp,
                                                                             "quick": args.quick,
                                                                             "distributed_optimizer": dopt}}, f, indent=2)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_ds-worker":
        _ds_iteration_worker(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    if argv and argv[0] == "--_tp-worker":
        _tp_iteration_worker(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--adapter", default="megatron_ref",
                    choices=["megatron_ref", "deepspeed", "torch_native", "megatron_core"],
                    help="which adapter's reconfiguration to measure")
    ap.add_argument("--controller-restart", action="store_true",
                    help="measure controller restart -> first committed iteration instead (docs/failover.md)")
    ap.add_argument("--model", default="llama", choices=["llama", "hf_llama"],
                    help="torch_native: the adapter's LLaMA, or the user's tiny HF LLaMA of examples/hf_llama")
    ap.add_argument("--tp", type=int, default=1, choices=[1, 2],
                    help="torch_native: 2 measures tensor parallelism (TP2 x PP2, the user's HF LLaMA)")
    ap.add_argument("--restore-at", metavar="I,J",
                    help="torch_native FSDP2 (or --adapter deepspeed: ZeRO 1): kill -> recommit on the restore path "
                         "after I and after J iterations")
    ap.add_argument("--kills", type=int, default=0,
                    help="deepspeed: how many kill repetitions (default 5, 1 with --quick)")
    ap.add_argument("--distributed-optimizer", action="store_true",
                    help="megatron_core: Megatron's distributed optimizer (its Adam shards gathered after each step)")
    ap.add_argument("--kill-only", action="store_true",
                    help="deepspeed: only the kill measurement (no fault-free engine comparison)")
    ap.add_argument("--fault-free-only", action="store_true",
                    help="torch_native: only the fault-free resilient-vs-stock comparison")
    ap.add_argument("--fault-free-phases", action="store_true",
                    help="torch_native: time each part of a fault-free iteration (resilient, commit in line, stock)")
    ap.add_argument("--fault-free-job", default="pp2dp2", choices=["pp2dp2", "dp4"],
                    help="torch_native fault-free comparison: pp2dp2 (resilient vs stock pipelining, issue 23) or "
                         "dp4 (ResiHP vs plain DDP and the adapter's stock FSDP blocks, issue 27)")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="torch_native fault-free comparison: ResiHP's checkpoint interval (0: none, as stock)")
    ap.add_argument("--baseline-tree", metavar="PATH",
                    help="torch_native fault-free comparison: also run ResiHP's workers from this checkout "
                         "(resihp@base), interleaved, for an A/B of a change")
    ap.add_argument("--fault-free-rounds", type=int, default=None,
                    help="torch_native: rounds of the fault-free comparison (default 5; 3 with --quick)")
    args = ap.parse_args(argv)
    if args.restore_at:
        return _main_restore_at(args)
    if args.controller_restart:
        return _main_controller_restart(args)
    if args.adapter == "deepspeed":
        try:
            return main_deepspeed(args)
        except Exception as e:  # noqa: BLE001 - could not measure: say so, exit non-zero
            print(f"reconfigure --adapter deepspeed could not measure: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.adapter == "megatron_core":
        return _main_megatron_core(args)
    if args.adapter == "torch_native":
        return _main_torch_native_tp(args) if args.tp == 2 else _main_torch_native(args)
    try:
        kill = kill_to_iteration(3 if args.quick else 5)
        mig = migration_vs_bytes(args.quick)
        pm = predictor_mape(args.quick)
    except Exception as e:  # noqa: BLE001 - report and fail: no number is better than a wrong one
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print("SIGKILL of one TP member, TP2xPP2xDP2, 8 CPU workers (median)")
    for k, v in kill.items():
        print(f"  {k:28s} {v:10.3f}" if isinstance(v, float) else f"  {k:28s} {v!s:>10}")
    print(f"  target kill->first iteration <= 2 s: {'met' if kill['kill_to_first_iteration_s'] <= 2 else 'NOT met'}")
    print("\nLayer migration (planned repartition, 2 workers)")
    print(f"  {'layers moved':>12} {'bytes moved':>12} {'state s':>9} {'rebuild s':>9} {'MB/s':>8}")
    for r in mig:
        rate = r["bytes_moved"] / r["state_s"] / 1e6 if r["state_s"] > 0 else float("nan")
        print(f"  {r['layers_moved']:>12} {r['bytes_moved']:>12} {r['state_s']:>9.4f} {r['rebuild_s']:>9.4f} {rate:>8.1f}")
    print("\nPredictor on real runs (PP2, 2 workers, fit on warm-up, held-out iterations)")
    for k, v in pm.items():
        print(f"  {k:28s} {v:10.4f}" if isinstance(v, float) else f"  {k:28s} {v:>10}")
    print(f"  target MAPE <= 5 %: {'met' if pm['iteration_mape_pct'] <= 5 else 'NOT met'} "
          f"(noise floor {pm['mape_floor_pct']:.2f} %, {pm['runs']} runs of every iteration; "
          f"beyond the floor {pm['mape_beyond_floor_pct']:.2f} %)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{f"kill_{k}": v for k, v in kill.items()}, "migration": mig, **pm,
                       "config": {"quick": args.quick}}, f, indent=2)
    return 0


def _main_fault_free_phases(args) -> int:
    try:
        res = torch_native_fault_free_phases(20 if args.quick else 30)
    except Exception as e:  # noqa: BLE001 - report and fail
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    systems = list(res)
    print("torch_native fault-free PP2xDP2 (HSDP, 4 CPU workers), one run each: ms per iteration per part, "
          "median over the 4 workers [per worker]")
    for k in systems:
        r = res[k]
        print(f"  {k}: {1e3 * r['iteration_s']:.1f} ms per iteration (commit rate), load {r['load'][0]:.1f}-"
              f"{r['load'][1]:.1f}, re-plans {r['replans']}, CPU s " +
              ", ".join(f"{role} {v:.1f}" for role, v in sorted(r["cpu_s"].items())))
    names = sorted({n for r in res.values() for n in r["parts_ms"]},
                   key=lambda n: -max(statistics.median(r["parts_ms"].get(n, [0.0])) for r in res.values()))
    print(f"  {'part':32s} " + " ".join(f"{k:>30s}" for k in systems))
    for n in names:
        cells = []
        for k in systems:
            v = res[k]["parts_ms"].get(n)
            cells.append(f"{statistics.median(v):7.2f} [{' '.join(f'{x:.1f}' for x in v)}]" if v else "-")
        print(f"  {n:32s} " + " ".join(f"{c:>30s}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"phases": res, "config": {"quick": args.quick}}, f, indent=2)
    return 0


def print_fault_free(ff: dict) -> None:
    """The fault-free comparison's table: wall and workers' CPU per iteration per system,
    each against the base system (stock, or plain DDP for dp4) round by round."""
    base = ff["base"]
    loads = ff["loadavg_1m"]
    print(f"torch_native fault-free, {ff['job']} (4 CPU workers), {ff['rounds']} rounds alternated, "
          f"{ff['iterations']} iterations each, ResiHP checkpoint every {ff['checkpoint_every'] or 'never'}; "
          f"load (1 min) {min(loads):.1f}-{max(loads):.1f}; seconds per iteration after a warm-up of 3")
    print(f"  {'system':14s} {'wall s':>8s} {'workers CPU s':>14s} {'agent CPU s':>12s} {'controller CPU s':>17s}   "
          "wall runs | workers' CPU runs")
    for k in ff["systems"]:
        cs = ff["cpu"][k]
        side = [statistics.median([c[key] for c in cs if c.get(key) == c.get(key) and key in c] or [math.nan])
                for key in ("parent_cpu_s", "other_cpu_s")]
        print(f"  {k:14s} {ff[k + '_iteration_s']:8.4f} {ff[k + '_worker_cpu_s']:14.4f} {side[0]:12.4f} {side[1]:17.4f}   "
              + " ".join(f"{x:.4f}" for x in ff["runs_s"][k]) + " | "
              + " ".join(f"{c.get('worker_cpu_s', math.nan):.4f}" for c in cs))
    for k in ff["systems"]:
        if k == base:
            continue
        print(f"  {k} vs {base}: wall {100 * ff[f'{k}_vs_{base}']:+.1f} % (per round "
              + " ".join(f"{100 * (x - 1):+.1f}" for x in ff[f"{k}_per_round_ratio"])
              + f"), workers' CPU {100 * ff[f'{k}_cpu_vs_{base}']:+.1f} % (per round "
              + " ".join(f"{100 * (x - 1):+.1f}" for x in ff[f"{k}_per_round_cpu_ratio"]) + ")")
    if "resihp_vs_base" in ff:
        print(f"  resihp (this tree) vs resihp@base ({ff['baseline_tree']}): wall {100 * ff['resihp_vs_base']:+.1f} % "
              "(per round " + " ".join(f"{100 * (x - 1):+.1f}" for x in ff["resihp_vs_base_per_round"])
              + f"), workers' CPU {100 * ff['resihp_cpu_vs_base']:+.1f} % (per round "
              + " ".join(f"{100 * (x - 1):+.1f}" for x in ff["resihp_vs_base_per_round_cpu"]) + ")")
    if ff["job"] == "pp2dp2":
        print(f"  target within 3 % (overlapped, the default, wall): "
              f"{'met' if ff['resihp_vs_stock'] <= 0.03 else 'NOT met'}")
    for r, system, n, before in ff["replans"]:
        print(f"  round {r + 1}: {system} re-planned {n} time(s) without a fault (the detector on a loaded "
              f"host); timed over the first plan's {before} iterations")
    for r, system, err in ff["failures"]:
        print(f"  round {r + 1}: {system} FAILED ({err[:120]}); that round's ratios left out")


def _main_torch_native(args) -> int:
    if args.fault_free_phases:
        return _main_fault_free_phases(args)
    ff = None
    try:
        res = {} if args.fault_free_only else torch_native_kill(1 if args.quick else 3, hf=args.model == "hf_llama")
        if args.model == "hf_llama" and args.fault_free_only:
            ff = hf_fault_free(args.fault_free_rounds or (3 if args.quick else 5), 20 if args.quick else 40)
        elif args.model == "llama":
            ff = torch_native_fault_free(args.fault_free_rounds or (3 if args.quick else 5), 20 if args.quick else 30,
                                         job_name=args.fault_free_job, checkpoint_every=args.checkpoint_every,
                                         baseline_tree=args.baseline_tree)
    except Exception as e:  # noqa: BLE001 - report and fail: no number is better than a wrong one
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    if ff is not None:
        (print_hf_fault_free if args.model == "hf_llama" else print_fault_free)(ff)
    if args.json and not res:
        with open(args.json, "w") as f:
            json.dump({"fault_free": ff, "config": {"quick": args.quick, "adapter": "torch_native",
                                                    "model": args.model, "loadavg": load}}, f, indent=2)
    if not res:
        return 0
    print(f"torch_native ({args.model}): SIGKILL of one rank, PP2xDP2 -> 3 survivors as PP3 (median; "
          f"load {' '.join(load)})")
    keys = list(next(iter(res.values())))
    print(f"  {'':28s} " + " ".join(f"{k:>12s}" for k in res))
    for k in keys:
        vals = [res[lbl][k] for lbl in res]
        print(f"  {k:28s} " + " ".join(f"{v:12.3f}" if isinstance(v, float) else f"{v:>12}" for v in vals))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{f"{lbl}_{k}": v for lbl, r in res.items() for k, v in r.items()},
                       "fault_free": ff, "config": {"quick": args.quick, "adapter": "torch_native", "model": args.model,
                                  "loadavg": load}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
