"""One prepared check of ResiHP on whatever devices this machine has (docs/gpu.md).

It runs, through the production path (``build_job`` + ``run_resilient``: agents, Detector,
Scheduler, supervisor), with ``runtime.backend = "auto"``:

* torch_native, PP2 x DP2: one worker SIGKILLed (kill -> first committed iteration,
  losses against the adapter's fault-free reference);
* torch_native, PP2 x DP2: one worker's compute slowed 3x (iterations until the plan
  changes, losses against the reference); not run with ``--quick``;
* torch_native with a GPU per worker over NCCL (DP = the host's GPUs, up to 4, fault-free:
  losses against the CPU reference); not run without a GPU;
* torch_native TP shrink: a pointer to ``reconfigure.py --adapter torch_native --tp 2``,
  which runs it on the user's HF LLaMA (the built-in model here has no TP plan);
* megatron_core with a GPU per worker over NCCL (the built-in ``pretrain_gpt``-shaped
  job, Megatron's distributed optimizer, DP = the host's GPUs up to 4, PP1, fault-free):
  losses against the same job on CPU workers over gloo (float32: Megatron's distributed
  optimizer takes float32 only, so held to 1e-4); not run without a GPU;
* communicators on several GPUs (one per rank, NCCL; skipped on one GPU, not run
  without one): a generation leaving one rank out, its world derived from the live one
  (a shrink where NCCL >= 2.27 and torch offer it) against the same generation rebuilt;
  and a survivor blocked in an all-reduce whose peer died, released by the abort watch;
* the reference backend's demo job (``resihp demo``'s configuration, TP2 x PP2 x DP2;
  with ``--quick`` TP2 x PP2 x DP1): one TP member SIGKILLed (a TP shrink), plus the
  predictor's iteration-time MAPE: per-stage costs fitted on warm-up iterations'
  per-micro-batch profiles (CUDA-event times on a GPU), predicted against measured on
  the fault-free iterations after them.

Each row names the device its workers computed on and the backend, by the same rule
the workers apply (:mod:`resihp_adapters.torchkit.device`). On one GPU every worker of the
reference backend shares ``cuda:0`` with transfers over gloo (NCCL refuses two ranks on
one device); torch_native's and DeepSpeed's transfers are torch's own and need NCCL for
CUDA tensors, so they stay on the CPU there. Prints a table, writes JSON (``--json``).

Usage: python benchmarks/gpu_check.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["main", "devices_here", "Row"]

#: Heartbeats lenient enough for a loaded machine: a false "hang", or an agent silent past
#: 2 x 50 x 0.2 s (a node lost), would be a fault of its own.
DETECTOR = {"heartbeat_interval_s": 0.2, "heartbeat_miss_limit": 50, "hang_min_timeout_s": 30.0,
            "warmup_iterations": 3, "min_changepoint_gap": 3}


@dataclass
class Row:
    """One scenario's outcome (``None``: not measured)."""

    scenario: str
    adapter: str
    device: str = ""
    backend: str = ""
    workers: int = 0
    fault: str = ""
    fault_to_first_s: float | None = None  # wall time from the commit before the fault to the first one after
    adapted_after: int | None = None  # iterations from the fault to the plan made for a report naming its device
    redone: int | None = None  # committed iterations trained again after the fault (lost progress)
    exact: bool | None = None
    worst_rel_diff: float | None = None
    mape_pct: float | None = None
    seconds: float = 0.0
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def devices_here() -> dict[str, Any]:
    """What this machine offers: torch, CUDA, GPU names."""
    import torch

    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "python": platform.python_version(), "host": platform.node(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def _placement(devices_per_node: int, own_transfers: bool) -> tuple[str, str]:
    """The device and backend local rank 0 gets under ``auto`` (the workers' own rule)."""
    import torch

    from resihp_adapters.torchkit.device import choose

    cuda = torch.cuda.is_available()
    p = choose("auto", local_rank=0, local_world=devices_per_node, own_transfers=own_transfers,
               cuda_available=cuda, gpu_count=torch.cuda.device_count() if cuda else 0)
    kind = "cuda" if p.is_cuda else "cpu"
    return kind, p.backend


def _run(data: dict, faults: list, work: Path, on_job: Callable[[Any], None] | None = None,
         on_iteration: Callable[[Any, Any], None] | None = None,
         adapter_extra: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """Run one job through the production path; returns (config, assembled job, run).
    ``adapter_extra``: job-spec adapter fields a configuration file cannot set (the
    user's model, which ``resihp launch`` takes from the user's script)."""
    from dataclasses import replace
    from resihp_core.config import Config
    from resihp_core.faults import repairs
    from resihp_core.protocols.events import observer
    from resihp_core.runtime.controller.jobs import build_job, phases
    from resihp_core.runtime.controller.resilient import AgentSetup, ResilientConfig, RunHooks, run_resilient

    cfg = Config.from_dict(data, source="gpu_check")
    job = build_job(cfg, faults, work)
    if adapter_extra:
        job = job._replace(spec=replace(job.spec, adapter_config={**job.spec.adapter_config, **adapter_extra}))
    holder: dict[str, Any] = {}

    def before_run(local_job, agents) -> None:
        holder["job"] = local_job
        if on_job is not None:
            on_job(local_job)

    def iteration(rec) -> None:
        if on_iteration is not None and "job" in holder:
            on_iteration(holder["job"], rec)

    run = run_resilient(ResilientConfig(spec=job.spec, plan=job.plan, topology=job.topology, state=job.state,
                                        planner=job.planner, detector=cfg.detector, iterations=cfg.training.iterations,
                                        workdir=work / "job", repairs=repairs(faults), timeout_s=600.0,
                                        agents=AgentSetup(timeout_s=300.0),
                                        hooks=RunHooks(phase_of=phases(faults), before_run=before_run,
                                                       observe=observer(iteration=iteration))))
    return cfg, job, run


def _judge(row: Row, cfg: Any, job: Any, run: Any, fault_at: int, victim: int) -> None:
    """Fill the row from the run: time to the first commit after the fault, how many
    iterations after it the plan changed for a report naming the faulty device (a
    report of another device, e.g. contention on a loaded machine, does not count),
    and the losses against the fault-free reference."""
    if not _ran(row, run):
        return
    recs = {r.iteration: r for r in run.records}
    if fault_at in recs:
        row.fault_to_first_s = recs[fault_at].seconds
    named = [ev["iteration"] for ev in run.events if ev.get("kind") == "failure"
             and victim in (ev.get("devices") or ()) and ev.get("iteration", -1) >= fault_at]
    plans = [ev["iteration"] for ev in run.events if ev.get("kind") == "plan" and named
             and ev.get("iteration", -1) >= min(named)]
    if plans:
        row.adapted_after = min(plans) - fault_at
    else:
        row.note = f"device {victim} never reported (load average {os.getloadavg()[0]:.0f})"
    resumes = [ev["resume"] for ev in run.events if ev.get("kind") == "plan" and ev.get("resume") is not None
               and ev.get("iteration", -1) >= fault_at]
    row.redone = max(0, fault_at - min(resumes)) if resumes else 0
    _exact(row, cfg, job, run)


def _ran(row: Row, run: Any) -> bool:
    """Keep the run's events in the row; False (and the row says why) if it failed."""
    row.extra["events"] = [f"{ev.get('iteration')}: {ev.get('kind')} {str(ev.get('text', ''))[:120]}"
                           for ev in run.events]
    if not run.ok or not run.records:
        row.note = f"run failed: {run.error[:200]}"
        row.exact = False
        return False
    return True


def _exact(row: Row, cfg: Any, job: Any, run: Any, tol: float | None = None) -> None:
    """The losses against the adapter's fault-free reference (``tol``: instead of the
    dtype's own tolerance)."""
    from resihp_core.cli.run import _reference_check

    if job.reference is None:
        row.note = "adapter has no fault-free reference"
        return
    recs = {r.iteration: r for r in run.records}
    losses = [recs[i].loss for i in sorted(recs)]
    ref = job.reference(job.spec, len(losses))
    worst, _, own = _reference_check(cfg, losses, ref)
    row.worst_rel_diff, row.exact = worst, worst <= (own if tol is None else tol)


def torch_native(kind: str, quick: bool, work: Path) -> Row:
    """torch_native PP2 x DP2 (float64, HSDP so a killed rank's shard survives): ``kind``
    is ``kill`` or ``slow``."""
    from resihp_core.faults import fail_at
    from resihp_core.plan import ParallelPlan

    iters = (6 if quick else 10) if kind == "kill" else 24
    at = 3 if kind == "kill" else 6
    data = {"parallel": {"tp": 1, "pp": 2, "dp": 2},
            "model": {"layers": 4, "hidden": 32, "heads": 4, "vocab": 64, "ffn_hidden": 64},
            "training": {"microbatches": 4, "token_budget": 64, "iterations": iters, "lr": 3e-3,
                         "dtype": "float64", "checkpoint_every": 0},
            "runtime": {"nodes": 2, "devices_per_node": 2, "adapter": "torch_native", "backend": "auto"},
            "adapter": {"shard": 1},
            "detector": DETECTOR}
    layout = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    victim = layout.group(1, 1)[0]
    fault = fail_at(victim, at, "kill") if kind == "kill" else fail_at(victim, at, "slow", factor=3.0)
    dev, backend = _placement(2, own_transfers=False)
    row = Row(f"torch_native {kind}", "torch_native", dev, backend, 4,
              f"{'SIGKILL' if kind == 'kill' else 'compute x3'} of device {victim} at iteration {at}")
    t0 = time.perf_counter()
    cfg, job, run = _run(data, [fault], work)
    row.seconds = time.perf_counter() - t0
    _judge(row, cfg, job, run, at, victim)
    return row


def torch_native_gpus(work: Path, hf: bool = False, backend: str = "nccl") -> Row:
    """torch_native with every worker on a GPU of its own over NCCL, as many as this host
    has GPUs (up to 4: DP = that many, fault-free; a host of one GPU gives a world of
    one). What it shows: the adapter's tensors all on the GPU (a host tensor in a forward
    or backward raises), the mixed ``cpu:gloo,cuda:nccl`` world, FSDP2 over NCCL, and the
    losses against the fault-free reference computed on the CPU (float64). ``hf``: the
    user's tiny HF LLaMA of examples/hf_llama (its AdamW, warm-up + cosine, clipping)
    instead of the adapter's LLaMA. ``backend="gloo"`` runs the same job on the CPU."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = min(gpus, 4) if backend == "nccl" else 1
    what = "HF LLaMA (user's)" if hf else "torch_native"
    row = Row(f"{what} on GPUs, {backend.upper()}", "torch_native", workers=n)
    if n == 0:
        row.note = "not run: no GPU here"
        return row
    data = {"parallel": {"tp": 1, "pp": 1, "dp": n},
            "model": {"layers": 4, "hidden": 32, "heads": 4, "vocab": 64, "ffn_hidden": 64},
            "training": {"microbatches": 4, "token_budget": 64, "iterations": 6, "lr": 3e-3,
                         "dtype": "float64", "checkpoint_every": 0},
            "runtime": {"nodes": 1, "devices_per_node": n, "adapter": "torch_native", "backend": backend},
            "detector": DETECTOR}
    saved_env, saved_path = os.environ.get("PYTHONPATH"), list(sys.path)
    if hf:  # the workers and the in-process reference import the user's hf_model
        here = Path(__file__).resolve().parents[1] / "examples" / "hf_llama"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), saved_env]))
        sys.path.insert(0, str(here))
        data["model"] = {"layers": 4, "hidden": 32, "heads": 4, "vocab": 256, "ffn_hidden": 64}
    row.device, row.backend, row.fault = ("cuda" if backend == "nccl" else "cpu"), backend, "none"
    # HF's RMSNorm and rotary tables compute in float32 inside a float64 model: on a GPU
    # they round differently from the CPU reference (1.0e-9 measured on an H200), so
    # the user's model is held to float32's resolution there.
    cross_device = hf and row.device == "cuda"
    try:
        t0 = time.perf_counter()
        cfg, job, run = _run(data, [], work, adapter_extra={"user": "hf_model:user_llama"} if hf else None)
        row.seconds = time.perf_counter() - t0
        row.note = f"DP{n}, fault-free"
        if _ran(row, run):
            _exact(row, cfg, job, run, tol=1e-6 if cross_device else None)
            if cross_device:
                row.note += f", within {row.worst_rel_diff:.1e} of the CPU reference (float32 inside HF)"
    finally:  # the later rows' workers see the environment they would have
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env
    return row


def megatron_core_gpus(work: Path) -> Row:
    """The megatron_core adapter on this host's GPUs (NCCL, Megatron-Core unmodified: no
    CPU bypass is applied where torch has CUDA), fault-free, against the same job on the
    CPU over gloo (the adapter's bypasses)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = min(gpus, 4)
    row = Row("megatron_core on GPUs, NCCL", "megatron_core", workers=n)
    if n == 0:
        row.note = "not run: no GPU here"
        return row
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        row.note = "not run: pip install 'resihp[megatron-core]'"
        return row

    def data(backend: str) -> dict:
        return {"parallel": {"tp": 1, "pp": 1, "dp": n},
                "model": {"layers": 4, "hidden": 32, "heads": 4, "vocab": 64, "ffn_hidden": 64},
                "training": {"microbatches": 2, "iterations": 6, "lr": 1e-3, "checkpoint_every": 0},
                "runtime": {"nodes": 1, "devices_per_node": n, "adapter": "megatron_core", "backend": backend},
                "adapter": {"distributed_optimizer": True}, "detector": DETECTOR}

    row.device, row.backend, row.fault = "cuda", "nccl", "none"
    t0 = time.perf_counter()
    _, _, run = _run(data("nccl"), [], work / "gpu")
    row.seconds = time.perf_counter() - t0
    if not _ran(row, run):
        return row
    _, _, ref = _run(data("gloo"), [], work / "cpu")
    if not ref.ok or not ref.records:
        row.note = f"CPU reference failed: {ref.error[:200]}"
        return row
    got = {r.iteration: r.loss for r in run.records}
    want = {r.iteration: r.loss for r in ref.records}
    row.worst_rel_diff = max(abs(got[i] - want[i]) / abs(want[i]) for i in want)
    row.exact = set(got) == set(want) and row.worst_rel_diff <= 1e-4
    row.note = f"DP{n}, distributed optimizer, fault-free, against the CPU run (float32)"
    return row


def torch_native_tp(quick: bool, work: Path) -> Row:
    """A TP group of torch_native shrinking around a killed member. Tensor parallelism
    takes its plan from the model (Hugging Face ``base_model_tp_plan``) or the user; the
    adapter's built-in LLaMA that this check trains has none, so the row points to the
    benchmark that runs the TP shrink on the user's HF LLaMA instead."""
    from resihp_adapters.torch_native.plugin import CAPABILITIES

    row = Row("torch_native TP shrink", "torch_native", workers=4)
    row.note = ("not run here: the built-in LLaMA has no TP plan; "
                "reconfigure.py --adapter torch_native --tp 2 runs it on the user's HF LLaMA"
                if CAPABILITIES.tp_resize else "not available: torch_native does not declare tp_resize")
    return row


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _comm_workers(mode: str, n: int, work: Path, limit_s: float = 240.0) -> list[dict[str, Any]]:
    """Run ``n`` processes of :func:`comm_worker` (one GPU each) and gather their reports."""
    import datetime
    import subprocess

    import torch.distributed as dist
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from group_creation import _wait_or_kill

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    procs = [subprocess.Popen([sys.executable, __file__, "--comm-worker", mode, str(r), str(n), str(store.port),
                               str(work)], stdout=subprocess.DEVNULL, stderr=open(work / f"{mode}{r}.log", "w"))
             for r in range(n)]
    _wait_or_kill(procs, limit_s)  # by pid, only what this check started
    out = []
    for r in range(n):
        f = work / f"{mode}{r}.json"
        if not f.exists():
            log = (work / f"{mode}{r}.log").read_text()[-300:]
            raise RuntimeError(f"{mode} rank {r} reported nothing (exit {procs[r].returncode}): {log}")
        out.append(json.loads(f.read_text()))
    return out


def comm_shrink(work: Path) -> Row:
    """Communicators of a generation that leaves one rank out, on one GPU per rank over
    NCCL, through the path every generation takes (torchkit.comm): the world derived
    from the live one (a shrink where NCCL >= 2.27 and torch offer it) against the same
    generation rebuilt; sums over the new groups checked."""
    n = min(_gpus(), 8)
    row = Row("NCCL shrink vs rebuild", "megatron_ref", workers=n, fault="leave one out")
    if n == 0:
        row.note = "not run: no GPU here"
        return row
    if n < 2:
        row.note = "skipped: needs >= 2 GPUs (NCCL refuses two ranks on one device)"
        return row
    row.device, row.backend = "cuda", "nccl"
    t0 = time.perf_counter()
    reports = _comm_workers("shrink", n, work)
    row.seconds = time.perf_counter() - t0
    live = [r for r in reports if "derived" in r]
    derived = max(r["derived"]["world_s"] + r["derived"]["subgroups_s"] for r in live)
    rebuilt = max(r["rebuilt"]["world_s"] + r["rebuilt"]["subgroups_s"] for r in live)
    path = live[0]["derived"]["comm_path"]
    row.exact = all(r["sums_ok"] for r in live)
    row.extra = {"derived_s": derived, "rebuilt_s": rebuilt, "path": path, "caps": live[0].get("caps")}
    row.note = f"{n} -> {n - 1} ranks: {path} {derived:.3f} s vs rebuild {rebuilt:.3f} s"
    return row


def comm_abort(work: Path) -> Row:
    """A survivor blocked in an NCCL all-reduce whose peer died is released by ResiHP's
    abort watch once its generation is superseded, long before the 60 s op timeout."""
    n = min(_gpus(), 4)
    row = Row("NCCL abort, blocked survivor", "megatron_ref", workers=n, fault="peer exits mid-collective")
    if n == 0:
        row.note = "not run: no GPU here"
        return row
    if n < 2:
        row.note = "skipped: needs >= 2 GPUs (NCCL refuses two ranks on one device)"
        return row
    row.device, row.backend = "cuda", "nccl"
    t0 = time.perf_counter()
    reports = _comm_workers("abort", n, work)
    row.seconds = time.perf_counter() - t0
    released = [r["released_s"] for r in reports if "released_s" in r]
    row.exact = len(released) == n - 1 and all(r["aborted"] for r in reports if "released_s" in r)
    row.fault_to_first_s = max(released) if released else None
    row.extra = {"released_s": released}
    row.note = (f"superseded -> released in {max(released):.2f} s (op timeout 60 s)" if released
                else "no survivor reported")
    return row


def comm_worker(mode: str, rank: int, n: int, port: int, work: Path) -> None:
    """One rank of :func:`comm_shrink` / :func:`comm_abort` on ``cuda:<rank>``."""
    import datetime

    import torch
    import torch.distributed as dist

    from resihp_core.plan import ParallelPlan
    from resihp_adapters.torchkit import comm, regroup
    from resihp_adapters.torchkit.device import AbortWatch, Placement

    pl = Placement(torch.device("cuda", rank), "nccl", "gpu_check")
    pl.activate()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    every = list(range(n))
    rest = every[:-1]

    def plan(devices: list[int]) -> ParallelPlan:
        return ParallelPlan.uniform(tp=1, pp=1, dp=len(devices), num_layers=1, num_microbatches=len(devices),
                                    devices=devices)

    def total(c: comm.Communicators, members: list[int]) -> bool:
        t = torch.ones(4, device=pl.device) * (rank + 1)
        dist.all_reduce(t, group=c.dp_chunks[0][0][1])
        return float(t[0].item()) == sum(d + 1 for d in members)

    report: dict[str, Any] = {}
    if mode == "shrink":
        c = comm.build_communicators(store, 0, every, rank, plan(every), 60.0, placement=pl)
        ok = total(c, every)
        report["caps"] = regroup.probe("nccl").__dict__
        if rank == n - 1:  # left out: takes no part, stays up until the others are through
            store.wait(["shrunk"], datetime.timedelta(seconds=120))
        else:
            c = comm.build_communicators(store, 1, rest, rank, plan(rest), 60.0, placement=pl, previous=c)
            report["derived"] = c.report()
            ok = ok and total(c, rest)
            if rank == 0:
                store.set("shrunk", "1")
        c = None
        comm.release(pl)
        c = comm.build_communicators(store, 2, every, rank, plan(every), 60.0, placement=pl)
        c = None
        comm.release(pl)  # the left-out rank has released its world: a rebuild for all
        if rank != n - 1:
            c = comm.build_communicators(store, 3, rest, rank, plan(rest), 60.0, placement=pl)
            report["rebuilt"] = c.report()
            ok = ok and total(c, rest)
            c = None
            comm.release(pl)
        report["sums_ok"] = ok
    else:
        c = comm.build_communicators(store, 0, every, rank, plan(every), 60.0, placement=pl)
        total(c, every)
        if rank == n - 1:  # dies without joining the next collective
            store.set("dying", "1")
            (work / f"{mode}{rank}.json").write_text(json.dumps(report))
            os._exit(0)
        watch = AbortWatch(pl, lambda: store.check(["superseded"])).start()
        store.wait(["dying"], datetime.timedelta(seconds=60))
        t = torch.ones(4, device=pl.device)
        dist.all_reduce(t, group=c.dp_chunks[0][0][1])  # queued: the peer never joins
        if rank == 0:
            time.sleep(1.0)
            store.set("superseded", str(time.time()))
        try:
            torch.cuda.synchronize(pl.device)
        except Exception as e:  # noqa: BLE001 - the aborted communicator's error
            report["error"] = str(e)[:200]
        report["released_s"] = time.time() - float(store.get("superseded"))
        report["aborted"] = watch.stop()
        c = None
    (work / f"{mode}{rank}.json").write_text(json.dumps(report))


def reference_demo(quick: bool, work: Path) -> Row:
    """The reference backend's demo job with a kill of one TP member (a TP shrink), and
    the predictor's MAPE on its fault-free iterations before the kill."""
    from resihp_core.faults import fail_at
    from resihp_core.plan import ParallelPlan

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
    from resihp_plugins.demo import DEMO_CONFIG

    dp = 1 if quick else 2
    skip, warm, held = 2, 3, (3 if quick else 12)
    at = skip + warm + held
    iters = at + (1 if quick else 8)
    data = {**DEMO_CONFIG, "parallel": {**DEMO_CONFIG["parallel"], "dp": dp},
            "training": {**DEMO_CONFIG["training"], "iterations": iters, "checkpoint_every": 0},
            "runtime": {"nodes": 2, "devices_per_node": 2 * dp, "backend": "auto"}, "detector": DETECTOR}
    p = data["parallel"]
    layout = ParallelPlan.uniform(tp=p["tp"], pp=p["pp"], dp=dp, num_layers=data["model"]["layers"],
                                  num_microbatches=data["training"]["microbatches"])
    victim = layout.group(0, 1)[1]
    dev, backend = _placement(2 * dp, own_transfers=True)
    row = Row(f"reference demo TP2xPP2xDP{dp}", "megatron_ref", dev, backend, 4 * dp,
              f"SIGKILL of device {victim} (stage 1's TP group) at iteration {at}")
    reports: dict[int, dict] = {}
    first_generation: list[int] = []

    def keep(local_job, rec) -> None:
        if not first_generation:
            first_generation.append(rec.generation)
        if rec.iteration < at and rec.generation == first_generation[0]:
            try:
                reports[rec.iteration] = local_job.report(rec.iteration)
            except Exception as e:  # noqa: BLE001 - a report that cannot be read is just not used
                row.extra.setdefault("report_errors", []).append(f"{type(e).__name__}: {e}"[:200])

    t0 = time.perf_counter()
    cfg, job, run = _run(data, [fail_at(victim, at, "kill")], work, on_iteration=keep)
    row.seconds = time.perf_counter() - t0
    _judge(row, cfg, job, run, at, victim)
    try:
        row.mape_pct, fit = _mape(cfg, job, layout, reports, skip, warm)
        row.extra.update(fit)
    except Exception as e:  # noqa: BLE001 - the table says why there is no number
        row.note = (row.note + "; " if row.note else "") + f"MAPE not measured: {type(e).__name__}: {e}"
    return row


def _mape(cfg: Any, job: Any, plan: Any, reports: dict[int, dict], skip: int, warm: int) -> tuple[float, dict]:
    """Fit each stage's cost on the warm-up iterations' micro-batch profiles, predict the
    later fault-free iterations, and return the iteration-time MAPE (percent)."""
    from resihp_core.plan import Topology
    from resihp_core.predictor.cost import CostModel, LinkModel, fit_stage, mape
    from resihp_core.predictor.predict import IterationPredictor, ModelShape
    from resihp_adapters.megatron_ref.adapter import data_spec
    from resihp_adapters.megatron_ref.data import lengths_of

    data = data_spec(job.spec)
    its = sorted(i for i in reports if i >= skip)
    fit_its, held_its = its[:warm], its[warm:]
    if not held_its:
        raise ValueError("no held-out iterations were reported")
    stages = []
    for s in range(plan.pp):
        samples = [(lengths_of(data, i, mb.owner, mb.mb), mb.forward_s, mb.backward_s)
                   for i in fit_its for d in plan.group(0, s) if d in reports[i]
                   for mb in reports[i][d].microbatches]
        stages.append(fit_stage(samples, ref_layers=plan.layers(s), ref_tp=plan.degree(0, s)))
    tokens = cfg.training.token_budget
    pred = IterationPredictor(CostModel(tuple(stages)), Topology.uniform(1, len(plan.devices())),
                              ModelShape(tokens=tokens, hidden=cfg.model.hidden, params_per_layer=1, dtype_bytes=4),
                              LinkModel(intra_bandwidth=2e9, intra_latency=50e-6))

    def predicted(i: int) -> float:
        wl = {(r, j): lengths_of(data, i, r, j) for r in range(plan.dp) for j in range(plan.num_microbatches)}
        return pred.predict(plan, wl).iteration_time

    def measured(i: int) -> float:
        return max(r.iteration_s for r in reports[i].values())

    # Per-iteration fixed costs (optimizer, loss bookkeeping, store) from the warm-up.
    overhead = statistics.median(measured(i) - predicted(i) for i in fit_its)
    meas = [measured(i) for i in held_its]
    preds = [predicted(i) + overhead for i in held_its]
    return mape(preds, meas), {"held_out_iterations": len(held_its), "warmup_iterations": len(fit_its),
                               "measured_mean_s": statistics.mean(meas), "predicted_mean_s": statistics.mean(preds)}


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec)


def table(rows: list[Row], here: dict[str, Any]) -> str:
    """The table ``gpu_check`` prints (docs/gpu.md shows how to read it)."""
    gpus = ", ".join(here["gpus"]) or "none"
    lines = [f"gpu_check: torch {here['torch']} (CUDA build {here['cuda_build'] or 'none'}), GPUs: {gpus}, "
             f"{here['date_utc']} UTC",
             f"{'scenario':28s} {'device':6s} {'backend':7s} {'workers':>7s} {'fault->first s':>14s} "
             f"{'replan after':>12s} {'redone':>6s} {'exact?':>6s} {'MAPE %':>7s}  note"]
    for r in rows:
        lines.append(f"{r.scenario:28s} {r.device or '-':6s} {r.backend or '-':7s} {r.workers:>7d} "
                     f"{_fmt(r.fault_to_first_s):>14s} {_fmt(r.adapted_after, 'd'):>12s} {_fmt(r.redone, 'd'):>6s} "
                     f"{_fmt(r.exact):>6s} "
                     f"{_fmt(r.mape_pct, '.1f'):>7s}  {r.note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: kill scenarios only, smaller jobs")
    ap.add_argument("--json", help="write the rows and the machine's description here")
    args = ap.parse_args(argv)
    here = devices_here()
    base = Path(tempfile.mkdtemp(prefix="resihp-gpu-check-"))
    rows: list[Row] = []
    steps: list[tuple[str, Callable[[Path], Row]]] = [
        ("tn_kill", lambda w: torch_native("kill", args.quick, w)),
    ]
    if not args.quick:
        steps.append(("tn_slow", lambda w: torch_native("slow", args.quick, w)))
    steps += [("tn_gpu", torch_native_gpus), ("hf_gpu", lambda w: torch_native_gpus(w, hf=True)),
              ("tn_tp", lambda w: torch_native_tp(args.quick, w)), ("mc_gpu", megatron_core_gpus),
              ("ref_demo", lambda w: reference_demo(args.quick, w)),
              ("comm_shrink", comm_shrink), ("comm_abort", comm_abort)]
    for name, step in steps:
        work = base / name
        work.mkdir(parents=True, exist_ok=True)
        try:
            rows.append(step(work))
        except Exception as e:  # noqa: BLE001 - one broken scenario must not hide the others
            rows.append(Row(name, "", note=f"error: {type(e).__name__}: {e}"[:300], exact=False))
        print(f"  {rows[-1].scenario}: done in {rows[-1].seconds:.1f} s", flush=True)
    if args.quick:
        rows.insert(1, Row("torch_native slow", "torch_native", note="not run with --quick"))
    print(table(rows, here))
    out = {"machine": here, "quick": args.quick, "rows": [r.__dict__ for r in rows],
           "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    ran = [r for r in rows if r.exact is not None]
    return 0 if ran and all(r.exact for r in ran) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--comm-worker":
        comm_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
    else:
        sys.exit(main())
