"""ResiHP next to what its users would run instead, on the same job, data and failures (issue 27).

Systems, each on the same CPU workers (gloo) with the same model (the torch_native
adapter's LLaMA, built by the same code from the same seeded configuration) and the same
data (the job's data source: every system reads micro-batch ``(iteration, replica, j)``
from it):

* ``resihp``: the job through ResiHP's production path (``build_job`` + ``run_resilient``,
  what ``resihp run CONFIG --faults FILE`` runs: agents, controller, detector, Scheduler,
  supervisor) on the torch_native adapter;
* ``torchft``: torchft 0.2.0 as its ``train_ddp.py`` example runs it: one replica group
  per worker, ``torchft.DistributedDataParallel`` + ``torchft.Optimizer``, gloo with a
  5 s timeout, ``PGTransport`` for healing, ``Manager(min_replica_size=1, timeout=30 s)``,
  a lighthouse (``torchft._torchft.LighthouseServer``, ``min_replicas=1``,
  ``join_timeout_ms=10000``, ``quorum_tick_ms=100``, heartbeat timeout 5 s by default as
  shipped: ``--torchft-heartbeat-ms``). It runs data parallelism only (no pipelines);
* ``ckpt``: checkpoint-restart: a plain torch script (DDP, or stock pipelining + FSDP2
  for PP2 x DP2) under ``torchrun --max-restarts`` that saves a checkpoint every ``k``
  iterations and loads the newest one at start; ``k`` from Young/Daly,
  ``sqrt(2 * C * MTBF)`` (``ckpt_interval``);
* ``plain``: the same script as ``ckpt`` without checkpoints or restarts (fault-free
  runs only): the reference for each system's fault-free overhead.

The third job, ``tp2pp2``, runs on the reference backend (megatron_ref): ResiHP on that
adapter, and checkpoint-restart running the backend's own Megatron-style model under
the same torchrun loop with Megatron-style per-rank checkpoints (``_ref_worker``;
``--check-ref`` proves it trains the same model, docs/benchmarks.md).

Checkpoint intervals: ResiHP and checkpoint-restart each checkpoint every ``k`` of
their iterations, ``k`` from Young/Daly with each system's own ``C`` (its own write:
ResiHP's DCP checkpoint, the script's ``torch.save`` or DCP) and its own fault-free
iteration time, both measured in a calibration run that checkpoints every iteration
(``own_checkpoint_cost``), and ``MTBF`` the kill-every-N trace's N of those iterations.
For ResiHP ``MTBF`` counts only the kills that leave some state without a live copy in
a replica's memory (``state_losing_kills``): the others it survives from memory, as
torchft does without checkpoints; where the trace has none, ResiHP runs without them.

Traces (seeded; the same events for every system; ``make_trace``): ``none``; ``one-kill``
(SIGKILL of one worker at the start of an iteration a third of the way in);
``kill-every-n`` (a SIGKILL every N iterations, the device repaired R iterations later:
ResiHP's runtime relaunches its worker and plans it back in, the driver restarts a
torchft replica, torchrun restarts every worker at once anyway); ``slow`` (one worker's
compute ``--slow-factor`` x slower from a third of the way in to the end).

Figures (``summarise``): iteration time of each fault-free system over plain torch's;
time from the commit before a kill to the next commit (the kill is at the start of the
next iteration, so this includes that iteration); iterations lost and done again per
failure; goodput (samples of the iterations in the final trajectory after the warm-up,
per second) as a ratio to the same system's fault-free run of the same round; and
ResiHP's goodput over each peer's. Rounds interleave the systems (their order rotates
every round) so the machine's drift hits all alike; medians with order-statistic
intervals (benchstats.py), the load average, and the fault-free runs' spread as the
noise floor. A run that does not reach the last iteration is reported as crashed.

Usage: python benchmarks/peers.py [--quick] [--reps N] [--jobs dp4,pp2dp2,tp2pp2] [--traces ...]
       [--max-wall-s S] [--json PATH] | --from-json PATH | --check-ref
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchstats import MedianCI, loadavg, machine, median_ci, rel_se  # noqa: E402

SYSTEMS = ("resihp", "torchft", "ckpt")
TRACES = ("none", "one-kill", "kill-every-n", "slow")


# ---------------------------------------------------------------- traces (pure)
@dataclass(frozen=True)
class Event:
    """At the start of ``iteration``: ``kill`` (SIGKILL the device's worker),
    ``repair`` (the device is back: its worker is started again), ``slow`` (its
    compute ``factor`` x slower from then on)."""

    iteration: int
    kind: str
    device: int
    factor: float = 1.0


def make_trace(name: str, iterations: int, devices: int, *, every: int = 10, repair_after: int = 5,
               slow_factor: float = 2.22, seed: int = 0) -> list[Event]:
    """The seeded failure trace ``name`` over ``iterations`` iterations of a job on
    ``devices`` workers. Device 0 is never a victim (it hosts torchrun's rank 0 and the
    first replica; any other is alike for every system)."""
    rng = random.Random(f"peers/{name}/{seed}")
    start = max(3, iterations // 3)
    if name == "none":
        return []
    if name == "one-kill":
        return [Event(start, "kill", rng.randrange(1, devices))]
    if name == "slow":
        return [Event(start, "slow", rng.randrange(1, devices), slow_factor)]
    if name != "kill-every-n":
        raise ValueError(f"unknown trace {name!r} (one of {', '.join(TRACES)})")
    if every < 2 or repair_after < 1:
        raise ValueError("kill-every-n needs every >= 2 and repair_after >= 1")
    out: list[Event] = []
    down: dict[int, int] = {}  # device -> iteration it is repaired at
    it = start
    while it < iterations - 2:
        down = {d: r for d, r in down.items() if r > it}
        victim = rng.choice([d for d in range(1, devices) if d not in down])
        out.append(Event(it, "kill", victim))
        if it + repair_after < iterations - 1:
            out.append(Event(it + repair_after, "repair", victim))
        down[victim] = it + repair_after
        it += every
    return sorted(out, key=lambda e: (e.iteration, e.kind != "repair"))


def mtbf_iterations(trace: Sequence[Event], iterations: int) -> float:
    """Mean iterations between kills of ``trace`` (its length when it has none)."""
    kills = sum(1 for e in trace if e.kind == "kill")
    return iterations / kills if kills else float(iterations)


def state_losing_kills(trace: Sequence[Event], job: Job) -> int:
    """Kills of ``trace`` after which some of ``job``'s state has no live copy: every
    device of the killed device's (stage, TP rank) in the job's initial layout is down
    (a repaired device is up again). Only these need a checkpoint where the state lives
    in replicas' memory, as it does for ResiHP and torchft; checkpoint-restart needs one
    for every kill."""
    from resihp_core.plan import ParallelPlan

    plan = ParallelPlan.uniform(tp=job.tp, pp=job.pp, dp=job.dp, num_layers=MODEL["layers"],
                                num_microbatches=job.microbatches, num_heads=MODEL["heads"])
    copies: dict[tuple[int, int], set[int]] = {}
    for rep in plan.tp_groups:
        for stage, group in enumerate(rep):
            for t, d in enumerate(group):
                copies.setdefault((stage, t), set()).add(d)
    holders = {d: ds for ds in copies.values() for d in ds}
    down: set[int] = set()
    lost = 0
    for e in trace:  # in order; a repair comes before a kill at the same iteration
        if e.kind == "repair":
            down.discard(e.device)
        elif e.kind == "kill":
            down.add(e.device)
            lost += holders[e.device] <= down
    return lost


def ckpt_interval(write_s: float, mtbf_s: float, iteration_s: float) -> int:
    """Young/Daly's checkpoint interval ``sqrt(2 C MTBF)``, in whole iterations (>= 1)."""
    if write_s < 0 or mtbf_s <= 0 or iteration_s <= 0:
        raise ValueError("need write_s >= 0, mtbf_s > 0 and iteration_s > 0")
    return max(1, round(math.sqrt(2.0 * write_s * mtbf_s) / iteration_s))


# ---------------------------------------------------------------- figures (pure)
@dataclass(frozen=True)
class Commit:
    """Iteration ``iteration`` committed at wall time ``t`` (s) with ``samples`` samples."""

    iteration: int
    t: float
    samples: int


def summarise(commits: Sequence[Commit], trace: Sequence[Event], iterations: int, warmup: int) -> dict:
    """Figures of one run from its commits (in commit order).

    * ``complete``: iteration ``iterations - 1`` committed;
    * ``goodput``: samples of iterations ``warmup+1 .. last`` as last committed (the final
      trajectory: an iteration done twice counts once) over the time from the first
      commit of ``warmup`` to the last commit;
    * ``iteration_s``: mean time per iteration from the first commit of ``warmup`` to the
      last first commit before the first event (a rate: periodic checkpoint writes count,
      as they cost the job; the median gap would leave them out); ``iteration_rse``: the
      relative standard error of the gaps between (the noise floor);
    * ``redone``: commits of an iteration already committed (work lost and done again);
    * per kill: ``gap_s`` from the last commit before it to the next commit, and
      ``back_s`` until the first commit of an iteration >= the kill's (its progress back).
    """
    order = sorted(commits, key=lambda c: c.t)
    last: dict[int, Commit] = {}
    first: dict[int, Commit] = {}
    redone = 0
    high = -1
    for c in order:
        if c.iteration <= high:
            redone += 1
        high = max(high, c.iteration)
        first.setdefault(c.iteration, c)
        last[c.iteration] = c
    out: dict = {"complete": (iterations - 1) in last, "committed": high + 1, "redone": redone}
    if warmup in first and high > warmup:
        t0 = first[warmup].t
        t1 = order[-1].t
        samples = sum(last[i].samples for i in range(warmup + 1, high + 1) if i in last)
        out["goodput"] = samples / (t1 - t0) if t1 > t0 else math.nan
        out["window_s"] = t1 - t0
    ev0 = min((e.iteration for e in trace), default=iterations)
    gaps = [first[i + 1].t - first[i].t for i in range(warmup, ev0 - 1) if i in first and i + 1 in first]
    steady = [i for i in range(warmup, ev0) if i in first]
    out["iteration_s"] = ((first[steady[-1]].t - first[warmup].t) / (steady[-1] - warmup)
                          if warmup in first and len(steady) > 1 and steady[-1] > warmup else math.nan)
    out["iteration_rse"] = rel_se(gaps)
    kills = []
    for e in trace:
        if e.kind != "kill":
            continue
        before = [c for c in order if c.iteration < e.iteration and c.iteration == e.iteration - 1]
        if not before:
            continue
        tb = before[0].t
        after = [c for c in order if c.t > tb]
        back = [c for c in after if c.iteration >= e.iteration]
        kills.append({"iteration": e.iteration, "device": e.device,
                      "gap_s": after[0].t - tb if after else math.nan,
                      "back_s": back[0].t - tb if back else math.nan})
    out["kills"] = kills
    nk = len(kills)
    out["redone_per_failure"] = redone / nk if nk else 0.0
    return out


# ---------------------------------------------------------------- jobs
@dataclass(frozen=True)
class Job:
    name: str
    pp: int
    dp: int
    microbatches: int  # per replica
    tp: int = 1
    adapter: str = "torch_native"  # ResiHP's backend; the peers run this backend's model

    @property
    def workers(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> str:
        return f"{f'TP{self.tp} x ' if self.tp > 1 else ''}PP{self.pp} x DP{self.dp}"

    @property
    def batch(self) -> int:
        return self.dp * self.microbatches


JOBS = {"dp4": Job("dp4", 1, 4, 3), "pp2dp2": Job("pp2dp2", 2, 2, 4),
        # The reference (Megatron-style) backend's TP2 x PP2: its own model, TP layers and
        # data; checkpoint-restart runs that model as a Megatron user would (_ref_worker).
        "tp2pp2": Job("tp2pp2", 2, 1, 4, tp=2, adapter="megatron_ref")}
#: Model sizes (resihp run's [model] section; 4 layers, heads divide every TP degree used):
#: xs is CI-sized (56 ms DP4 steps here, where ResiHP's fixed per-iteration cost dominates),
#: m and l have the step times users have (0.9 and 3.6 s for DP4 on this CPU).
SIZES = {
    "xs": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "ffn_hidden": 128},
    "s": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 256, "ffn_hidden": 1024},
    "m": {"layers": 4, "hidden": 512, "heads": 8, "vocab": 256, "ffn_hidden": 2048},
    "l": {"layers": 4, "hidden": 1024, "heads": 16, "vocab": 256, "ffn_hidden": 4096},
}
MODEL = dict(SIZES["xs"])
WARMUP = 3  # iterations before the figures start (start-up, first-plan effects)
TIMEOUT_S = 10.0  # every system's collective timeout where it has one to set (torchft: its example's)
HEARTBEAT_MISSES = 50  # x 0.1 s: ResiHP's hang timeout matched to torchft's 5 s heartbeat timeout


def resihp_config(job: Job, iterations: int, checkpoint_dir: str, checkpoint_every: int = 1) -> dict:
    """The ``resihp run`` configuration of ``job`` (the peers read its model and data),
    checkpointing every ``checkpoint_every`` iterations."""
    return {
        "parallel": {"tp": job.tp, "pp": job.pp, "dp": job.dp},
        "model": dict(MODEL),
        "training": {"microbatches": job.microbatches, "token_budget": 64, "iterations": iterations,
                     "lr": 0.003, "checkpoint_dir": checkpoint_dir, "checkpoint_every": checkpoint_every},
        "runtime": {"adapter": job.adapter, "nodes": 1, "devices_per_node": job.workers,
                    "controller_port": 0},
        # HSDP copies (shard 1): a dead rank's state survives in a peer replica's memory
        # (the reference backend keeps whole copies in its replicas by design).
        "adapter": {"shard": 1} if job.adapter == "torch_native" else {},
        # A hang is declared after 5 s without a heartbeat: torchft's lighthouse heartbeat
        # timeout as shipped (a dead process is seen at once by its exit). 0.1 s x 8, the
        # example's setting, killed healthy workers at load 30 on 2 cores (docs/benchmarks.md).
        # One node, so no partition to find: its agent, starved for more than 10 s at load
        # ~52, was declared lost with all its devices (docs/benchmarks.md); a dead agent's
        # closed connection is seen at once whatever this limit.
        "detector": {"heartbeat_interval_s": 0.1, "heartbeat_miss_limit": HEARTBEAT_MISSES,
                     "hang_min_timeout_s": 20.0, "warmup_iterations": 3, "min_changepoint_gap": 3,
                     "agent_silence_s": 60.0},
    }


def job_spec_json(job: Job, iterations: int, work: Path) -> str:
    """The workers' JobSpec of ``job`` as ResiHP assembles it (model and data for the peers)."""
    from resihp_core.config import Config
    from resihp_core.runtime.controller.jobs import build_job

    cfg = Config.from_dict(resihp_config(job, iterations, str(work / "ckpt")))
    return build_job(cfg, [], work).spec.to_json()


# ---------------------------------------------------------------- runs
@dataclass
class Run:
    system: str
    job: str
    trace: str
    commits: list[Commit] = field(default_factory=list)
    ok: bool = True
    error: str = ""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


def run_resihp(job: Job, trace: list[Event], iterations: int, work: Path, timeout: float,
               checkpoint_every: int = 1) -> Run:
    """The job through ResiHP's production path (what ``resihp run --faults`` runs)."""
    from resihp_core.config import Config
    from resihp_core.faults import Fault, repairs
    from resihp_core.runtime.controller.jobs import build_job
    from resihp_core.protocols.events import JobEvent, PlanPosted, observer
    from resihp_core.runtime.controller.resilient import AgentSetup, ResilientConfig, RunHooks, run_resilient

    faults = [Fault(e.device, e.iteration, e.kind, e.factor) for e in trace]
    cfg = Config.from_dict(resihp_config(job, iterations, str(work / "ckpt"), checkpoint_every))
    aj = build_job(cfg, faults, work)
    run = Run("resihp", job.name, "")
    t0 = time.time()

    def on_iteration(rec) -> None:
        run.commits.append(Commit(rec.iteration, time.time(), int(rec.samples)))

    resumes: list[tuple[int, int]] = []  # (iterations committed, iteration the next generation resumes at)

    def on_event(ev: JobEvent) -> None:
        if isinstance(ev, PlanPosted) and ev.resume is not None:
            resumes.append((len(run.commits), ev.resume))

    # agent_timeout (``resihp run --agent-timeout``, 60 s by default) bounds the agent's and
    # its workers' start: at load 30 on 2 cores the workers' imports alone took longer.
    res = run_resilient(ResilientConfig(spec=aj.spec, plan=aj.plan, topology=aj.topology, state=aj.state,
                                        planner=aj.planner, detector=cfg.detector, iterations=iterations,
                                        workdir=work / "job", repairs=repairs(faults), timeout_s=timeout,
                                        agents=AgentSetup(timeout_s=timeout),
                                        hooks=RunHooks(observe=observer(iteration=on_iteration, job=on_event))))
    run.ok, run.error, run.wall_s = res.ok, res.error[:300], time.time() - t0
    # The supervisor reports each iteration once; a generation that resumes before the
    # iterations already committed (a restore) trains them again: put them in the log,
    # committed just before the next new iteration (their own times are not reported).
    for n, r in reversed(resumes):
        if r < n < len(run.commits):
            t_next = run.commits[n].t
            redo = [Commit(i, t_next - 1e-6 * (n - i), run.commits[i].samples) for i in range(r, n)]
            run.commits[n:n] = redo
    run.extra["resumes"] = resumes
    run.extra["plans"] = [e.get("text", "")[:160] for e in res.events if e.get("kind") == "plan"]
    # what the detector reported and what the payback rule decided: why a run did or did not re-plan
    run.extra["decisions"] = [f"{e.get('iteration')} {e['kind']}: {e.get('text', '')[:300]}" for e in res.events
                              if e.get("kind") in ("failure", "replan", "recovered")]
    return run


def _read_commits(paths: Iterable[Path]) -> list[Commit]:
    out = []
    for p in paths:
        if p.exists():
            for line in p.read_text().splitlines():
                try:
                    it, t, s = line.split()
                    out.append(Commit(int(it), float(t), int(s)))
                except ValueError:
                    continue  # a line cut by a kill
    return out


def _reap(procs: Iterable[subprocess.Popen], grace: float = 5.0) -> None:
    """Stop the processes this benchmark started (by pid): SIGTERM, then SIGKILL."""
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _worker_cmd(system: str, args: dict) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--_worker", system, json.dumps(args)]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_torchft(job: Job, trace: list[Event], iterations: int, work: Path, spec: str, timeout: float,
                heartbeat_ms: int) -> Run:
    """torchft: one replica group per worker, a lighthouse in this process; a repaired
    device's replica is started again once the repair iteration has committed."""
    if job.pp != 1 or job.tp != 1:
        raise ValueError("torchft runs data-parallel replicas only (no pipelines, no tensor parallelism)")
    lh = _Lighthouse(work, heartbeat_ms)
    run = Run("torchft", job.name, "", extra={"heartbeat_timeout_ms": heartbeat_ms})
    logs = [work / f"commits{r}.txt" for r in range(job.dp)]
    procs: dict[int, subprocess.Popen] = {}
    all_procs: list[subprocess.Popen] = []

    def start(r: int) -> None:
        a = {"spec": spec, "replica": r, "iterations": iterations, "out": str(work), "lighthouse": lh.address(),
             "trace": [asdict(e) for e in trace], "m": job.microbatches}
        log = open(work / f"worker{r}.log", "ab")  # noqa: SIM115 - the child holds it
        procs[r] = subprocess.Popen(_worker_cmd("torchft", a), env=_env(), stdout=log, stderr=subprocess.STDOUT)
        all_procs.append(procs[r])

    t0 = time.time()
    try:
        for r in range(job.dp):
            start(r)
        repairs = sorted((e.iteration, e.device) for e in trace if e.kind == "repair")
        while True:
            commits = _read_commits(logs)
            high = max((c.iteration for c in commits), default=-1)
            while repairs and high >= repairs[0][0] - 1:
                _, d = repairs.pop(0)
                if procs[d].poll() is not None:
                    start(d)
            if high >= iterations - 1:
                break
            if all(p.poll() is not None for p in procs.values()):
                run.ok, run.error = False, f"every replica exited (codes {[p.returncode for p in procs.values()]})"
                break
            if time.time() - t0 > timeout:
                run.ok, run.error = False, f"no progress to iteration {iterations - 1} in {timeout:.0f} s"
                break
            time.sleep(0.05)
    finally:
        _reap(all_procs)
        lh.shutdown()
    run.wall_s = time.time() - t0
    # One commit per step: the first replica that saw it commit (every participant commits it).
    seen: dict[int, Commit] = {}
    for c in sorted(_read_commits(logs), key=lambda c: c.t):
        seen.setdefault(c.iteration, c)
    run.commits = sorted(seen.values(), key=lambda c: c.t)
    if not run.ok:
        run.error += "; " + _tail([work / f"worker{r}.log" for r in range(job.dp)])
    return run


class _Lighthouse:
    """torchft's lighthouse (``torchft._torchft.LighthouseServer``, the server its
    ``torchft_lighthouse`` command runs) in a child process, its log in ``work``."""

    def __init__(self, work: Path, heartbeat_ms: int) -> None:
        code = ("import sys; from torchft._torchft import LighthouseServer as L; "
                f"s = L(bind='[::]:0', min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100, "
                f"heartbeat_timeout_ms={int(heartbeat_ms)}); print(s.address(), flush=True); sys.stdin.read()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(work / "lighthouse.log", "ab"), text=True)
        line = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if not line:
            _reap([self.proc])
            raise RuntimeError(f"torchft lighthouse did not start (log: {work / 'lighthouse.log'})")
        self._address = line

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        _reap([self.proc])


def _tail(paths: Iterable[Path], n: int = 400) -> str:
    for p in paths:
        if p.exists():
            text = p.read_text(errors="replace")
            for key in ("AssertionError", "Error", "Traceback"):
                i = text.find(key)
                if i >= 0:
                    return f"{p.name}: " + text[i:i + n].replace("\n", " | ")
    return ""


def run_torchrun(system: str, job: Job, trace: list[Event], iterations: int, work: Path, spec: str,
                 timeout: float, every: int, max_restarts: int) -> Run:
    """``plain`` (no checkpoints, no restarts) or ``ckpt`` (a checkpoint every ``every``
    iterations, ``torchrun --max-restarts``), the script in ``_torchrun_worker``;
    ``plain-fsdp``: ``plain`` built from the torch_native adapter's stock blocks even
    for ``pp = 1`` (``PipelineStage`` + ``fully_shard`` HSDP instead of DDP), to tell
    their cost from ResiHP's (docs/benchmarks.md)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = {"spec": spec, "iterations": iterations, "out": str(work), "trace": [asdict(e) for e in trace],
         "pp": job.pp, "tp": job.tp, "dp": job.dp, "m": job.microbatches,
         "every": every if system == "ckpt" else 0, "fsdp": system == "plain-fsdp",
         "ref": job.adapter == "megatron_ref"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(job.workers),
           "--max-restarts", str(max_restarts if system == "ckpt" else 0), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"peers-{os.getpid()}",
           *_worker_cmd("torchrun", a)[1:]]
    # Without it restarted gloo workers read the dead workers' addresses from the shared
    # rendezvous store and fail or hang (torch 2.13; docs/benchmarks.md).
    env = dict(_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    run = Run(system, job.name, "", extra={"checkpoint_every": a["every"], "max_restarts": max_restarts})
    t0 = time.time()
    log = open(work / "torchrun.log", "ab")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        rc = p.wait(timeout=timeout)
        if rc != 0:
            run.ok, run.error = False, f"torchrun exited {rc}; " + _tail([work / "torchrun.log"])
    except subprocess.TimeoutExpired:
        run.ok, run.error = False, f"timed out after {timeout:.0f} s"
    finally:
        _reap([p], grace=10.0)
    run.wall_s = time.time() - t0
    run.commits = _read_commits([work / "commits.txt"])
    run.extra["restarts"] = len(list(work.glob("start-*")))
    wt = [float(x) for x in (work / "ckpt_write_s.txt").read_text().split()] if (work / "ckpt_write_s.txt").exists() else []
    if wt:
        run.extra["checkpoint_write_s"] = statistics.median(wt)
    return run


# ---------------------------------------------------------------- workers
def _model_and_data(spec_json: str):
    import torch

    from resihp_adapters.torch_native.adapter import parse_config
    from resihp_adapters.torch_native.data import Batches, job_source
    from resihp_core.job import JobSpec

    torch.set_num_threads(1)
    js = JobSpec.from_json(spec_json)
    c = parse_config(js.adapter_config, js.seed)
    return js, c, Batches(job_source(js, c["model"].vocab_size), c["model"].torch_dtype)


class _Faults:
    """A worker's view of the trace: SIGKILL itself at the start of a kill's iteration
    (once: a marker file survives the restart), and its slowdown factor."""

    def __init__(self, trace: list[dict], device: int, out: Path) -> None:
        self.events = [Event(**e) for e in trace if e["device"] == device]
        self.device, self.out, self.factor = device, out, 1.0

    def at(self, iteration: int) -> None:
        for e in self.events:
            if e.iteration == iteration and e.kind == "kill":
                marker = self.out / f"killed-{e.iteration}-{e.device}"
                if not marker.exists():
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
            if e.iteration <= iteration and e.kind == "slow":
                self.factor = e.factor

    def stretch(self, seconds: float) -> None:
        if self.factor > 1.0:
            time.sleep((self.factor - 1.0) * seconds)


def _torchrun_worker(a: dict) -> None:
    """Plain torch under torchrun: DDP (pp 1) or stock pipelining + FSDP2 (pp > 1); with
    ``every`` > 0 a checkpoint every ``every`` iterations, the newest loaded at start."""
    import datetime

    import torch
    import torch.distributed as dist

    if a.get("ref"):
        _ref_worker(a)
        return
    out = Path(a["out"])
    rank = int(os.environ["RANK"])
    (out / f"start-{rank}-{os.getpid()}").touch()
    js, c, data = _model_and_data(a["spec"])
    cfg, m, pp, every = c["model"], a["m"], a["pp"], a["every"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    faults = _Faults(a["trace"], rank, out)
    ckdir = out / "checkpoints"
    ckdir.mkdir(exist_ok=True)
    newest = ckdir / "newest"
    start = int(newest.read_text()) if every and newest.exists() else 0
    log = open(out / "commits.txt", "a") if rank == 0 else None
    if pp == 1 and not a.get("fsdp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from resihp_adapters.torch_native.model import build_stage, loss_sum

        model = build_stage(cfg, 0, cfg.n_layers)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=c["weight_decay"], foreach=False)
        if start:
            st = torch.load(ckdir / f"step{start}.pt", weights_only=False)
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optim"])

        def step(it: int) -> None:
            import contextlib

            denom = float(sum(data.micro_batch(it, rank, j, m).labels.ne(-100).sum() for j in range(m)))
            t0 = time.perf_counter()
            for j in range(m):
                mb = data.micro_batch(it, rank, j, m)
                with ddp.no_sync() if j < m - 1 else contextlib.nullcontext():
                    (loss_sum(ddp(mb.tokens, **mb.kwargs()), mb.labels) / denom).backward()
            faults.stretch(time.perf_counter() - t0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def save(it: int) -> None:
            if rank == 0:
                path = ckdir / f"step{it}.pt"
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, str(path) + ".tmp")
                os.replace(str(path) + ".tmp", path)
                _publish(newest, it)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from resihp_adapters.torch_native.reference import StockPipeline

        sp = StockPipeline(cfg, data, pp=pp, num_microbatches=m, shard=1, lr=c["lr"], weight_decay=c["weight_decay"])
        if start:
            msd, osd = get_state_dict(sp.module, sp.optimizer)
            groups = [dict(g) for g in osd["param_groups"]]
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(ckdir / f"step{start}"))
            set_state_dict(sp.module, sp.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            # The loaded groups lack the tuple-valued hyper-parameters (AdamW's betas: DCP
            # does not bring them back); they are the job's own, the same on every restart.
            for g, fresh in zip(sp.optimizer.param_groups, groups):
                for key, v in fresh.items():
                    if key != "params":
                        g.setdefault(key, v)
        sp.iteration = start

        def step(it: int) -> None:
            t0 = time.perf_counter()
            sp.step()
            faults.stretch(time.perf_counter() - t0)

        def save(it: int) -> None:
            msd, osd = get_state_dict(sp.module, sp.optimizer)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckdir / f"step{it}"))
            dist.barrier()
            if rank == 0:
                _publish(newest, it)

    _train(a, start, step, save, faults, log, out, samples=a["dp"] * m, rank=rank)


def _train(a: dict, start: int, step, save, faults, log, out: Path, *, samples: int, rank: int) -> None:
    """A checkpoint-restart worker's loop from ``start``: step, log the committed samples,
    save every ``a["every"]`` iterations (rank 0 logs each write's seconds), then leave."""
    import torch.distributed as dist

    every = a["every"]
    for it in range(start, a["iterations"]):
        faults.at(it)
        step(it)
        if log is not None:
            log.write(f"{it} {time.time():.6f} {samples}\n")
            log.flush()
        if every and (it + 1) % every == 0 and it + 1 < a["iterations"]:
            t0 = time.perf_counter()
            save(it + 1)
            if rank == 0:
                with open(out / "ckpt_write_s.txt", "a") as f:
                    f.write(f"{time.perf_counter() - t0:.6f}\n")
    dist.barrier()
    dist.destroy_process_group()


def _publish(newest: Path, it: int) -> None:
    tmp = newest.with_suffix(".tmp")
    tmp.write_text(str(it))
    os.replace(tmp, newest)


def _ref_worker(a: dict) -> None:
    """The reference backend's TP x PP model under torchrun, as a Megatron user runs a
    Megatron model: the same ``StageModule`` layers (column/row-parallel linears,
    vocab-parallel embedding and loss) and seeded weights, data and AdamW as ResiHP's
    megatron_ref adapter; rank = stage x TP + TP rank (TP innermost, Megatron's order);
    GPipe (every micro-batch's forward, then every backward) with blocking send/recv
    between the same TP rank of adjacent stages. With ``every`` > 0 a checkpoint every
    ``every`` iterations the way Megatron's ``--save-interval`` writes one: each rank
    ``torch.save``s its own shard (parameters and AdamW moments: Megatron's per-rank
    ``mp_rank_XX`` files), a barrier, then rank 0 publishes the iteration (Megatron's
    ``latest_checkpointed_iteration.txt``); at start the newest is loaded (``--load``)."""
    import datetime

    import torch
    import torch.distributed as dist

    from resihp_adapters.megatron_ref.adapter import data_spec, model_config
    from resihp_adapters.megatron_ref.data import label_count, micro_batch
    from resihp_adapters.megatron_ref.model import build_stage
    from resihp_adapters.megatron_ref.state import AdamW
    from resihp_core.job import JobSpec

    torch.set_num_threads(1)
    out = Path(a["out"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (out / f"start-{rank}-{os.getpid()}").touch()
    tp, pp, m, every = a["tp"], a["pp"], a["m"], a["every"]
    if a["dp"] != 1 or world != tp * pp:
        raise ValueError(f"the reference script runs TP x PP with one replica, not {a} on {world} ranks")
    js = JobSpec.from_json(a["spec"])
    cfg, data = model_config(js), data_spec(js)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    stage, t = divmod(rank, tp)
    groups = [dist.new_group(list(range(k * tp, (k + 1) * tp))) for k in range(pp)]  # every rank makes every group
    bounds = [round(k * cfg.num_layers / pp) for k in range(pp + 1)]
    module = build_stage(cfg, (bounds[stage], bounds[stage + 1]), stage == 0, stage == pp - 1,
                         groups[stage], t, tp)
    opt = AdamW(lr=float(js.adapter_config.get("lr", 1e-3)))
    faults = _Faults(a["trace"], rank, out)
    ckdir = out / "checkpoints"
    ckdir.mkdir(exist_ok=True)
    newest = ckdir / "newest"
    start = int(newest.read_text()) if every and newest.exists() else 0
    if start:
        saved = torch.load(ckdir / f"step{start}" / f"rank{rank}.pt", weights_only=True)
        with torch.no_grad():
            for name, p in module.named_parameters():
                sp, sm, sv = saved[name]
                p.copy_(sp)
                opt.state[name] = (sm.clone(), sv.clone())
    log = open(out / "commits.txt", "a") if rank == 0 else None
    first, last = stage == 0, stage == pp - 1

    def step(it: int) -> None:
        denom = float(label_count(data, it))
        ins, outs = [], []
        busy = 0.0
        for j in range(m):
            mb = micro_batch(data, it, 0, j)
            if first:
                x = mb.tokens
            else:
                x = torch.empty(sum(mb.lengths), cfg.hidden, dtype=cfg.torch_dtype)
                dist.recv(x, src=rank - tp)
                x.requires_grad_()
            t0 = time.perf_counter()
            y = module(x, mb.lengths, mb.labels) / denom if last else module(x, mb.lengths)
            busy += time.perf_counter() - t0
            if not last:
                dist.send(y.detach(), dst=rank + tp)
            ins.append(x)
            outs.append(y)
        for j in range(m):
            g = None
            if not last:
                g = torch.empty_like(outs[j])
                dist.recv(g, src=rank + tp)
            t0 = time.perf_counter()
            outs[j].backward(g)
            busy += time.perf_counter() - t0
            if not first:
                dist.send(ins[j].grad, dst=rank - tp)
        faults.stretch(busy)
        params = dict(module.named_parameters())
        opt.step(params, it + 1)
        for p in params.values():
            p.grad = None

    def save(it: int) -> None:
        folder = ckdir / f"step{it}"
        folder.mkdir(exist_ok=True)
        shard = {name: (p.detach(), *opt.ensure(name, p)) for name, p in module.named_parameters()}
        path = folder / f"rank{rank}.pt"
        torch.save(shard, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        dist.barrier()
        if rank == 0:
            _publish(newest, it)

    _train(a, start, step, save, faults, log, out, samples=m, rank=rank)


def _torchft_worker(a: dict) -> None:
    """One torchft replica group of one worker, as torchft's train_ddp.py builds it."""
    import contextlib
    import gc
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    from resihp_adapters.torch_native.model import build_stage, loss_sum
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    out, r, m = Path(a["out"]), a["replica"], a["m"]
    js, c, data = _model_and_data(a["spec"])
    cfg = c["model"]
    faults = _Faults(a["trace"], r, out)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the replica group's (torchrun's) store
    model = build_stage(cfg, 0, cfg.n_layers)
    inner = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=c["weight_decay"], foreach=False)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"peers_{r}", timeout=timedelta(seconds=30), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=a["lighthouse"],
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")))
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    log = open(out / f"commits{r}.txt", "a")
    while manager.current_step() < a["iterations"]:
        it = manager.current_step()
        faults.at(it)
        opt.zero_grad()  # starts the quorum
        denom = float(sum(data.micro_batch(it, r, j, m).labels.ne(-100).sum() for j in range(m)))
        t0 = time.perf_counter()
        for j in range(m):
            mb = data.micro_batch(it, r, j, m)
            with ddp.no_sync() if j < m - 1 else contextlib.nullcontext():
                (loss_sum(ddp(mb.tokens, **mb.kwargs()), mb.labels) / denom).backward()
        faults.stretch(time.perf_counter() - t0)
        opt.step()  # steps only if the quorum commits
        if manager.current_step() > it:  # committed (a healing replica's counter jumps to the quorum's step)
            log.write(f"{manager.current_step() - 1} {time.time():.6f} {manager.num_participants() * m}\n")
            log.flush()
    manager.shutdown(wait=False)
    # The manager leaves its gloo group alive: drop it now, not at interpreter shutdown
    # (where a gloo thread can abort the finished worker, docs/torch_native.md "Exit").
    pg.shutdown()
    del ddp, opt, manager
    gc.collect()


def check_ref(root: Path, iterations: int = 3) -> float:
    """The largest difference between checkpoint-restart's tp2pp2 script (``_ref_worker``,
    float64, a checkpoint after every iteration) and the reference backend's own
    single-process training (``reference_trajectory``): every parameter and AdamW moment
    of every rank's shard after ``iterations - 1`` iterations. Near 0 says the peer
    trains the very model and data ResiHP's megatron_ref adapter does."""
    import torch

    from resihp_adapters.megatron_ref.adapter import data_spec, model_config
    from resihp_adapters.megatron_ref.model import shard_dim
    from resihp_adapters.megatron_ref.reference import reference_trajectory
    from resihp_core.config import Config
    from resihp_core.job import JobSpec
    from resihp_core.runtime.controller.jobs import build_job

    job = JOBS["tp2pp2"]
    d = resihp_config(job, iterations, str(root / "ckpt"))
    d["training"]["dtype"] = "float64"
    spec = build_job(Config.from_dict(d), [], root / "spec").spec.to_json()
    work = root / "run"
    work.mkdir(parents=True)
    run = run_torchrun("ckpt", job, [], iterations, work, spec, 600, 1, 0)
    if not run.ok:
        raise RuntimeError(f"the tp2pp2 checkpoint-restart script failed: {run.error}")
    js = JobSpec.from_json(spec)
    *_, (_, _, ref) = reference_trajectory(model_config(js), data_spec(js), iterations - 1,
                                           lr=float(js.adapter_config["lr"]))
    worst, names = 0.0, set()
    for rank in range(job.workers):
        shard = torch.load(work / "checkpoints" / f"step{iterations - 1}" / f"rank{rank}.pt", weights_only=True)
        for name, mine in shard.items():
            dim = shard_dim(name)
            for a, full in zip(mine, ref[name]):
                b = full if dim is None else full.chunk(job.tp, dim)[rank % job.tp]
                worst = max(worst, float((a - b).abs().max()))
            names.add(name)
    if names != set(ref):
        raise RuntimeError(f"the shards hold {sorted(names)}, the model {sorted(ref)}")
    return worst


# ---------------------------------------------------------------- driver
def logged_checkpoint_writes(folder: Path) -> list[tuple[int, float]]:
    """``(iteration, seconds)`` of every checkpoint write that ResiHP's workers logged
    under ``folder`` (``worker*.log``: ``event=checkpoint_written ... seconds=S``), by
    iteration."""
    found: list[tuple[int, float]] = []
    for log in sorted(folder.rglob("worker*.log")):
        for m in re.finditer(r"event=checkpoint_written device=\d+ iteration=(\d+)\b[^\n]*?\bseconds=([0-9.]+)",
                             log.read_text(errors="replace")):
            found.append((int(m.group(1)), float(m.group(2))))
    return sorted(found)


def own_checkpoint_cost(system: str, job: Job, root: Path, spec: str, args: argparse.Namespace,
                        iterations: int = 12, skip: int = 2) -> tuple[float, float, list[float]]:
    """``C`` and the iteration time of Young/Daly for ``system`` (``resihp`` or ``ckpt``),
    each from its own writes, as its users would measure them: one fault-free run of the
    job checkpointing after every iteration. ResiHP: the workers' logged DCP writes
    (``event=checkpoint_written ... seconds=S``: the coordinator's collective write and
    seal); checkpoint-restart: rank 0's timed ``save`` (``torch.save`` for DDP, DCP +
    barrier for the pipeline). Checkpoint-restart writes on the training path: ``C`` is
    the median after the first ``skip`` writes and the iteration time the run's commit
    gap less ``C`` (each gap holds one write). ResiHP writes in the background, so its
    commit gap does not hold the write and its logged write time is not what a
    checkpoint costs the job: ``C`` is the commit gap checkpointing every iteration less
    the commit gap of a second run without checkpoints, which is the iteration time
    (Young/Daly's ``C`` is the time a checkpoint takes from training).
    Returns ``(C, iteration_s, writes)``."""
    work = Path(tempfile.mkdtemp(prefix=f"calibrate-{system}-{job.name}-", dir=root))
    if system == "resihp":
        run = run_resihp(job, [], iterations, work, args.run_timeout, checkpoint_every=1)
        # One checkpoint per iteration, as long as its slowest writer (the reference
        # backend writes one file set per stage, each logged by its writer).
        per_it: dict[int, float] = {}
        for i, w in logged_checkpoint_writes(work):
            per_it[i] = max(w, per_it.get(i, 0.0))
        writes = [w for i, w in sorted(per_it.items()) if i >= skip] or list(per_it.values())
    elif system == "ckpt":
        run = run_torchrun("ckpt", job, [], iterations, work, spec, args.run_timeout, 1, 0)
        f = work / "ckpt_write_s.txt"
        got = [float(x) for x in f.read_text().split()] if f.exists() else []
        writes = got[skip:] or got
    else:
        raise ValueError(f"no checkpoints in {system!r}")
    if not run.ok:
        raise RuntimeError(f"{system}'s calibration run failed: {run.error}")
    if not writes:
        raise RuntimeError(f"{system}'s calibration run logged no checkpoint writes (under {work})")
    gap = summarise(run.commits, [], iterations, skip)["iteration_s"]
    if system == "resihp":
        bare = run_resihp(job, [], iterations, work / "bare", args.run_timeout, checkpoint_every=0)
        if not bare.ok:
            raise RuntimeError(f"resihp's calibration run without checkpoints failed: {bare.error}")
        iteration_s = summarise(bare.commits, [], iterations, skip)["iteration_s"]
        return max(gap - iteration_s, 1e-3), iteration_s, writes
    c = statistics.median(writes)
    return c, max(gap - c, 1e-3), writes


def one_run(system: str, job: Job, trace_name: str, trace: list[Event], iterations: int, root: Path,
            spec: str, args: argparse.Namespace, every: int) -> Run:
    work = Path(tempfile.mkdtemp(prefix=f"{system}-{job.name}-{trace_name}-", dir=root))
    timeout = args.run_timeout
    try:
        if system == "resihp":
            run = run_resihp(job, trace, iterations, work, timeout, every)
            run.extra["checkpoint_every"] = every
        elif system == "torchft":
            run = run_torchft(job, trace, iterations, work, spec, timeout, args.torchft_heartbeat_ms)
        else:
            run = run_torchrun(system, job, trace, iterations, work, spec, timeout, every, args.max_restarts)
    except Exception as e:  # noqa: BLE001 - a system that cannot run is a result, reported as such
        run = Run(system, job.name, trace_name, ok=False, error=f"{type(e).__name__}: {e}"[:300])
    run.trace = trace_name
    return run


def _ci(xs: Sequence[float]) -> MedianCI:
    return median_ci([x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)])


def _txt(c: MedianCI, fmt: str = "{:.2f}") -> str:
    """``median [lo .. hi]`` (the interval's confidence is stated once, under the table)."""
    if c.n == 0:
        return "-"
    m = fmt.format(c.median)
    return m if c.n == 1 else f"{m} [{fmt.format(c.lo)} .. {fmt.format(c.hi)}]"


def table(job: Job, runs: list[Run], iterations: int, warmup: int, traces: dict[str, list[Event]],
          systems: Sequence[str]) -> tuple[list[str], dict]:
    """The job's table lines and figures."""
    by: dict[tuple[str, str], list[dict]] = {}
    rounds: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(runs):
        s = summarise(r.commits, traces[r.trace], iterations, warmup)
        s["ok"], s["error"], s["round"] = r.ok and s["complete"], r.error, r.extra.get("round", 0)
        by.setdefault((r.system, r.trace), []).append(s)
        rounds.setdefault((r.system, r.trace), []).append(s["round"])
    fig: dict = {}
    lines = [f"### {job.name}: {job.layout}, {job.workers} CPU workers, {iterations} iterations "
             f"of {job.batch} samples (goodput after iteration {warmup})", "",
             "Each cell: median [order-statistic interval: the min-max range up to 5 values, a 75 % "
             "interval for 3 values, 94 % for 5]; kill figures pool every kill of every run.", ""]
    plain = by.get(("plain", "none"), [])
    base_it = _ci([s["iteration_s"] for s in plain])
    lines += ["fault-free iteration time (each run's mean from its warm-up to its end, checkpoint writes "
              "included), and over plain torch in the same round:", "",
              "| system | iteration s | / plain torch | noise floor (rel. s.e. of a run's iterations) |",
              "| --- | --- | --- | --- |"]
    for sysname in ("plain", *systems):
        ss = by.get((sysname, "none"), [])
        if not ss:
            continue
        its = _ci([s["iteration_s"] for s in ss])
        ratios = [s["iteration_s"] / p["iteration_s"] for s in ss for p in plain if p["round"] == s["round"]]
        rc = _ci(ratios)
        floor = statistics.median([s["iteration_rse"] for s in ss]) if ss else math.nan
        fig[f"{sysname} fault-free iteration_s"] = its.to_dict()
        fig[f"{sysname} fault-free / plain"] = rc.to_dict()
        lines.append(f"| {sysname} | {_txt(its, '{:.3f}')} | {_txt(rc)} | {100 * floor:.1f} % |")
        for i, x in enumerate(ss):
            if not x["ok"]:
                lines.append(f"|  | {sysname}: fault-free run {i + 1} did not finish: {x['error'][:160]} |  |  |")
    del base_it
    lines += ["", "| trace | system | completed | kill -> next commit s | back to the killed iteration s | "
              "redone per failure | goodput samples/s | goodput / own fault-free | resihp / system |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for tname in traces:
        if tname == "none":
            continue
        for sysname in systems:
            ss = by.get((sysname, tname), [])
            if not ss:
                continue
            done = sum(1 for s in ss if s["ok"])
            gap = _ci([k["gap_s"] for s in ss for k in s["kills"]])
            back = _ci([k["back_s"] for s in ss for k in s["kills"]])
            red = _ci([s["redone_per_failure"] for s in ss if s["kills"]])
            good = _ci([s.get("goodput", math.nan) for s in ss if s["ok"]])
            own = {s["round"]: s.get("goodput", math.nan) for s in by.get((sysname, "none"), []) if s["ok"]}
            rel = _ci([s["goodput"] / own[s["round"]] for s in ss if s["ok"] and s["round"] in own])
            mine = {s["round"]: s.get("goodput", math.nan) for s in by.get(("resihp", tname), []) if s["ok"]}
            vs = _ci([mine[s["round"]] / s["goodput"] for s in ss if s["ok"] and s["round"] in mine])
            crashed = [s["error"][:160] for s in ss if not s["ok"]]
            key = f"{sysname} {tname}"
            fig[key] = {"completed": done, "runs": len(ss), "kill_to_next_commit_s": gap.to_dict(),
                        "back_to_killed_iteration_s": back.to_dict(), "redone_per_failure": red.to_dict(),
                        "goodput": good.to_dict(), "goodput_over_fault_free": rel.to_dict(),
                        "resihp_over_system": vs.to_dict(), "failures": crashed}
            lines.append(f"| {tname} | {sysname} | {done}/{len(ss)} | {_txt(gap)} | {_txt(back)} | "
                         f"{_txt(red, '{:.1f}')} | {_txt(good, '{:.1f}')} | {_txt(rel)} | "
                         f"{'-' if sysname == 'resihp' else _txt(vs)} |")
            for i, why in enumerate(crashed):
                lines.append(f"|  | {sysname}: run {i + 1} did not finish | {why} |  |  |  |  |  |  |")
    return lines, fig


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized: 1 round, dp4 only, fault-free and kill-every-n")
    ap.add_argument("--reps", type=int, help="rounds (default 3; 1 with --quick)")
    ap.add_argument("--size", choices=tuple(SIZES), default="xs", help="model size (default xs)")
    ap.add_argument("--jobs", help=f"comma-separated of {', '.join(JOBS)} (default all; dp4 with --quick)")
    ap.add_argument("--traces", help=f"comma-separated of {', '.join(TRACES)}")
    ap.add_argument("--iterations", type=int, help="iterations per run (default 60; 30 with --quick)")
    ap.add_argument("--every", type=int, default=None, help="kill-every-n: iterations between kills")
    ap.add_argument("--repair-after", type=int, default=None, help="kill-every-n: iterations until the repair")
    ap.add_argument("--slow-factor", type=float, default=2.22, help="slow trace: compute slowdown (medium: 2.22)")
    ap.add_argument("--torchft-heartbeat-ms", type=int, default=5000, help="torchft lighthouse heartbeat timeout "
                    "(5000: as shipped)")
    ap.add_argument("--max-restarts", type=int, default=10, help="torchrun --max-restarts for checkpoint-restart")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a run counts as stuck")
    ap.add_argument("--resihp-checkpoint-every", default="young-daly",
                    help="ResiHP's checkpoint interval in iterations; young-daly: Young/Daly from "
                         "ResiHP's own measured DCP write time and iteration, with the MTBF of the kills "
                         "that leave some state without a live copy in a replica (none: no checkpoints); "
                         "young-daly-kills: the MTBF of every kill, as checkpoint-restart "
                         "(1 is resihp run's default)")
    ap.add_argument("--max-wall-s", type=float, default=0.0, help="start no round that would end past this "
                    "many seconds from the start (by the mean round so far; 0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every run and figure here")
    return ap


def _settings(args: argparse.Namespace) -> tuple[int, int, int, int, list[Job], list[str]]:
    """Rounds, iterations, N and R of kill-every-N, jobs and traces, defaults filled in."""
    reps = args.reps or (1 if args.quick else 3)
    iterations = args.iterations or (30 if args.quick else 60)
    every = args.every or (10 if args.quick else 15)
    repair_after = args.repair_after or 5
    jobs = [JOBS[j] for j in (args.jobs or ("dp4" if args.quick else ",".join(JOBS))).split(",")]
    tnames = (args.traces or ("none,kill-every-n" if args.quick else ",".join(TRACES))).split(",")
    if "none" not in tnames:
        tnames.insert(0, "none")
    return reps, iterations, every, repair_after, jobs, tnames


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_worker":
        a = json.loads(argv[2])
        {"torchrun": _torchrun_worker, "torchft": _torchft_worker}[argv[1]](a)
        # Every iteration is logged and the group destroyed: leave without the
        # interpreter's teardown, where a gloo thread's destructor now and then aborts
        # the process ("terminate called without an active exception", SIGABRT) and
        # torchrun counts a finished run as failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    ap = _parser()
    ap.add_argument("--from-json", help="print the report of a saved run (--json's file) with this code, run nothing")
    ap.add_argument("--check-ref", action="store_true", help="check that checkpoint-restart's tp2pp2 script trains "
                    "the reference backend's model exactly (float64 against its single-process training), run nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text()))[0])
        return 0
    if args.check_ref:
        worst = check_ref(Path(tempfile.mkdtemp(prefix="resihp-peers-check-")))
        print(f"tp2pp2 checkpoint-restart script vs the reference backend's single-process training, float64, "
              f"2 iterations: every parameter and AdamW moment of every shard within {worst:.1e}")
        return 0 if worst < 1e-10 else 1
    reps, iterations, every, repair_after, jobs, tnames = _settings(args)
    MODEL.clear()
    MODEL.update(SIZES[args.size])  # resihp_config and the peers' job spec read it
    try:
        import torchft  # noqa: F401
        have_torchft = True
    except ImportError as e:
        have_torchft = False
        print(f"torchft is not installed ({e}): its column is skipped (pip install -e '.[peers]')")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(tempfile.mkdtemp(prefix="resihp-peers-"))
    load: list[list[float] | None] = [loadavg()]
    t_start = time.time()
    out: dict = {"machine": machine(), "command": "python benchmarks/peers.py " + " ".join(argv),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "size": args.size,
           "model": dict(MODEL), "jobs": {}}
    setup: dict[str, dict] = {}
    for job in jobs:
        systems = [s for s in SYSTEMS if s != "torchft" or (have_torchft and job.pp == 1 and job.tp == 1)]
        setup[job.name] = {
            "systems": systems, "order": ["plain", *systems], "runs": [], "k": {},
            "traces": {t: make_trace(t, iterations, job.workers, every=every, repair_after=repair_after,
                                     slow_factor=args.slow_factor, seed=args.seed) for t in tnames},
            "kev": make_trace("kill-every-n", iterations, job.workers, every=every, repair_after=repair_after,
                              seed=args.seed),
            "spec": job_spec_json(job, iterations, root / f"spec-{job.name}")}
    done_rounds = 0
    cut = ""  # why the last round stopped short (--max-wall-s passed inside it)
    for rnd in range(reps):  # a round runs every job; --max-wall-s starts none that would not end in time
        elapsed = time.time() - t_start
        if rnd and args.max_wall_s and elapsed + elapsed / rnd > args.max_wall_s:
            print(f"stopping after {rnd} of {reps} rounds: another would pass --max-wall-s "
                  f"{args.max_wall_s:.0f} s ({elapsed:.0f} s so far)", flush=True)
            break
        # Traces outside jobs: a round cut short by --max-wall-s loses its last trace(s)
        # for every job alike, not a whole job.
        for tname, job in ((t, j) for t in tnames for j in jobs):
            st = setup[job.name]
            runs, k, spec, traces = st["runs"], st["k"], st["spec"], st["traces"]
            if args.max_wall_s and time.time() - t_start > args.max_wall_s:
                cut = (f"round {rnd + 1} stopped at --max-wall-s {args.max_wall_s:.0f} s before trace "
                       f"{tname} of {job.name}")
                print(cut, flush=True)
                break
            sys_now = st["order"] if tname == "none" else st["systems"]
            sys_now = sys_now[rnd % len(sys_now):] + sys_now[:rnd % len(sys_now)]  # rotate each round
            for sysname in sys_now:
                if sysname in ("ckpt", "resihp") and sysname not in k:
                    # ResiHP's Young/Daly counts only the kills that lose state (None: every kill)
                    losing = (state_losing_kills(st["kev"], job)
                              if sysname == "resihp" and args.resihp_checkpoint_every == "young-daly" else None)
                    if sysname == "resihp" and args.resihp_checkpoint_every not in ("young-daly", "young-daly-kills"):
                        k["resihp"] = int(args.resihp_checkpoint_every)
                    elif losing == 0:
                        # Every kill of the trace leaves a copy of the state in a replica's
                        # memory: like torchft, ResiHP needs no checkpoint for them
                        # (Young/Daly's MTBF is that of state-losing failures: none here).
                        k["resihp"] = 0
                        out["jobs"].setdefault(job.name, {})["resihp_no_state_loss"] = True
                        print(f"{job.name} resihp: no kill of the trace loses every copy of any state -> "
                              "no checkpoints", flush=True)
                    else:
                        # Young/Daly from the system's own write time and fault-free iteration
                        # (a calibration run checkpointing every iteration); the trace kills
                        # every N of its iterations, so its MTBF is N of its own iterations.
                        for attempt in range(3):  # a start that timed out at this load is no measurement
                            try:
                                c_s, it_s, writes = own_checkpoint_cost(sysname, job, root, spec, args)
                                break
                            except RuntimeError as e:
                                print(f"{job.name} {sysname}: calibration attempt {attempt + 1} failed: "
                                      f"{str(e)[:300]}", flush=True)
                                out.setdefault("calibration_failures", []).append(
                                    {"job": job.name, "system": sysname, "error": str(e)[:300]})
                        else:
                            raise RuntimeError(f"{job.name} {sysname}: 3 calibration runs failed")
                        mtbf_s = (iterations / losing if losing else mtbf_iterations(st["kev"], iterations)) * it_s
                        k[sysname] = ckpt_interval(c_s, mtbf_s, it_s)
                        out["jobs"].setdefault(job.name, {}).setdefault("young_daly", {})[sysname] = {
                            "checkpoint_write_s": c_s, "writes_s": writes, "mtbf_s": mtbf_s,
                            "iteration_s": it_s, "every": k[sysname],
                            "mtbf_from": "state-losing kills" if losing else "kills",
                            "c_from": "gaps" if sysname == "resihp" else "writes"}
                        print(f"{job.name} {sysname}: Young/Daly C {c_s:.3f} s (median of {len(writes)} "
                              f"writes), iteration {it_s:.3f} s -> a checkpoint every {k[sysname]}", flush=True)
                r = one_run(sysname, job, tname, traces[tname], iterations, root, spec, args,
                            k.get(sysname, 0))
                r.extra["round"] = rnd
                load.append(loadavg())
                runs.append(r)
                if args.json:  # every run so far, in case the benchmark is stopped
                    Path(args.json + ".partial").write_text(json.dumps(
                        [{"system": x.system, "job": x.job, "trace": x.trace, "ok": x.ok, "error": x.error,
                          "extra": x.extra, "commits": [asdict(c) for c in x.commits]}
                         for v in setup.values() for x in v["runs"]]))
                print(f"[{time.time() - t_start:6.0f} s] {job.name} round {rnd + 1}/{reps} {tname:<13} "
                      f"{sysname:<8} {'ok' if r.ok else 'FAILED'} {len(r.commits)} commits "
                      f"{r.wall_s:.1f} s{'' if r.ok else ' ' + r.error[:200]}", flush=True)
        if cut:
            break
        done_rounds = rnd + 1
    loads = [x[0] for x in load if x]
    out.update({"loadavg": [min(loads), max(loads)], "rounds": done_rounds, "cut": cut, "wall_s": time.time() - t_start,
                "have_torchft": have_torchft})
    for job in jobs:
        out["jobs"].setdefault(job.name, {})["traces"] = {
            t: [asdict(e) for e in ev] for t, ev in setup[job.name]["traces"].items()}
        if "resihp" in setup[job.name]["k"]:
            out["jobs"][job.name]["resihp_checkpoint_every"] = setup[job.name]["k"]["resihp"]
    out["runs"] = [{"system": r.system, "job": r.job, "trace": r.trace, "ok": r.ok, "error": r.error,
                    "wall_s": r.wall_s, "extra": r.extra, "commits": [asdict(c) for c in r.commits]}
                   for job in jobs for r in setup[job.name]["runs"]]
    md, figs = render(out)
    for name, fig in figs.items():
        out["jobs"][name]["figures"] = fig
    out["markdown"] = md
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


def render(saved: dict) -> tuple[str, dict[str, dict]]:
    """The report (markdown) and each job's figures, from a run's saved record (what
    ``--json`` writes: its command, date, load, every run's commits): the live run and
    ``--from-json`` print the same thing."""
    args = _parser().parse_args(shlex.split(saved["command"])[2:])
    reps, iterations, _, _, jobs, _ = _settings(args)
    warmup = WARMUP
    report: list[str] = []
    figs: dict[str, dict] = {}
    for job in jobs:
        saved_job = saved["jobs"].get(job.name, {})
        runs = [Run(x["system"], x["job"], x["trace"], [Commit(**c) for c in x["commits"]], x["ok"], x["error"],
                    x.get("wall_s", 0.0), x.get("extra", {})) for x in saved["runs"] if x["job"] == job.name]
        traces = {t: [Event(**e) for e in ev] for t, ev in saved_job.get("traces", {}).items()}
        ran = {r.system for r in runs}
        systems = [s for s in SYSTEMS if s in ran]
        lines, fig = table(job, runs, iterations, warmup, traces, systems)
        figs[job.name] = fig
        how = ({"ckpt": "rank 0's timed save: every rank's torch.save of its shard + barrier",
                "resihp": "the slowest stage writer's logged background write: gathered TP shards, one "
                          "verified file per component"} if job.adapter == "megatron_ref" else
               {"ckpt": "rank 0's timed save: torch.save for DDP, DCP + barrier for the pipeline",
                "resihp": "the coordinator's logged DCP write and seal"})
        for sysname, yd in saved_job.get("young_daly", {}).items():
            if yd.get("c_from") == "gaps":  # background writes: C is what they take from training
                c_how = (f"C: the commit gap of a calibration run checkpointing every iteration less that of "
                         f"one without checkpoints, its writes running in the background (their logged "
                         f"median {statistics.median(yd['writes_s']) * 1e3:.1f} ms: {how[sysname]}); "
                         f"iteration: the run without checkpoints' commit gap")
            else:
                c_how = (f"C: median of {len(yd['writes_s'])} of its own writes ({how[sysname]}) in a calibration "
                         f"run checkpointing every iteration; iteration: that run's commit gap less C")
            lines += ["", f"{sysname}: a checkpoint every {yd['every']} iteration(s) = "
                      f"sqrt(2 x C {yd['checkpoint_write_s'] * 1e3:.1f} ms x MTBF {yd['mtbf_s']:.1f} s) / "
                      f"iteration {yd['iteration_s']:.3f} s (Young/Daly, rounded, >= 1; {c_how}; MTBF: "
                      + ("the kill-every-N trace's iterations over its kills that leave some state without a "
                         "live copy" if yd.get("mtbf_from") == "state-losing kills" else
                         "the kill-every-N trace's N of those iterations") + ")"]
        if "resihp" in ran and saved_job.get("resihp_no_state_loss"):
            lines += ["", "resihp: no checkpoints (Young/Daly with the MTBF of failures that lose every "
                      "copy of some state: no kill of the kill-every-N trace leaves a stage without a live "
                      "replica holding its state in memory; as for torchft)"]
        elif "resihp" in ran and "resihp" not in saved_job.get("young_daly", {}):
            fixed = saved_job.get("resihp_checkpoint_every", args.resihp_checkpoint_every)
            lines += ["", f"resihp: a checkpoint every {fixed} iteration(s) (--resihp-checkpoint-every)"]
        if job.pp != 1 or job.tp != 1:
            lines += ["", "torchft: not run (it runs data-parallel replicas; it has no pipeline or tensor "
                      "parallelism)"]
        elif "torchft" not in ran:
            lines += ["", "torchft: not installed, column skipped"]
        report += lines + [""]
    done, lo, hi = saved.get("rounds", reps), *saved.get("loadavg", [math.nan, math.nan])
    took = f", {saved['wall_s']:.0f} s" if "wall_s" in saved else ""
    head = [f"# peers: ResiHP vs torchft vs checkpoint-restart ({saved['date']}{took})",
            f"`{saved['command']}`; load average (1 min) {lo:.1f}-{hi:.1f} during the runs; "
            f"model size {args.size} ({', '.join(f'{k} {v}' for k, v in SIZES[args.size].items())}); "
            f"{done} round(s){'' if done == reps else f' of {reps} asked (stopped by --max-wall-s)'}"
            f"{'; then ' + saved['cut'] + ' (its runs up to there are counted)' if saved.get('cut') else ''}, "
            f"jobs and systems interleaved (order rotated every round); medians with "
            f"order-statistic intervals (min-max below 4 values).",
            f"timeouts: collectives {TIMEOUT_S:.0f} s (ResiHP job, torchrun workers), torchft gloo 5 s / manager 30 s "
            f"/ lighthouse heartbeat {args.torchft_heartbeat_ms} ms; ResiHP heartbeat 0.1 s x {HEARTBEAT_MISSES} "
            f"(a dead process is seen by its exit); torchrun "
            f"--max-restarts {args.max_restarts}, default monitor interval.", ""]
    return "\n".join(head + report), figs

if __name__ == "__main__":
    sys.exit(main())
