"""The cost of being resilient: each adapter's fault-free iteration time against the stock
framework running the same model, data and layout, over model sizes (issue 35).

Jobs (peers.py's, each through ResiHP's production path: agents, controller, detector,
supervisor, the commit protocol; the stock side under ``torchrun``, peers.py's script):

* ``dp4``    torch_native PP1 x DP4 (HSDP copies)    vs plain DDP;
* ``pp2dp2`` torch_native PP2 x DP2                  vs stock ``PipelineStage`` + FSDP2;
* ``tp2pp2`` megatron_ref TP2 x PP2                  vs the same Megatron-style model under
  torchrun with per-rank checkpoints (peers.py's ``_ref_worker``);
* ``ds_pp2dp2`` deepspeed PP2 x DP2: the DeepSpeed user's GPT pipeline (``ds_gpt_train.py``:
  tied embedding and LM head, 4 causal transformer blocks of the size's width, dropout,
  gradient clipping, torch AdamW, DeepSpeed's own loader; ZeRO 0, float32) under
  ``resihp launch`` (its production path: the accelerate config and DeepSpeed JSON,
  controller, agents, supervisor) vs the same script with ``--stock`` under ``torchrun``:
  DeepSpeed's ``PipelineModule`` + ``deepspeed.initialize`` + ``train_batch``, no ResiHP
  code. 4 micro-batches of ``DS_MICRO_BATCH`` x 16 tokens per replica (pp2dp2's 64
  tokens per micro-batch). Checkpoints: ResiHP's own (``resihp.checkpoint_every``) and
  DeepSpeed's ``engine.save_checkpoint``. Both sides log the global mean loss per
  iteration; the row states the largest relative difference of any run's from the stock
  run's of its round (``loss_max_rel_diff_vs_stock``: the same training, float32 printing
  aside). (``reconfigure.py --adapter deepspeed`` steps both engines side by side in one
  world instead, without the runtime.)

Model sizes (``SIZES``: hidden 64 .. 1024, 4 layers) are swept so that the stock
iteration spans from tens of milliseconds to seconds on a 2-core CPU machine; the
stock iteration time each size reached is in the output, so the span is visible.

Four systems per job and size, run one after the other in an order that changes every
round (``run_order``: the machine's drift hits all alike, and each run without
checkpoints follows a checkpointing run of the other system): ``stock``; ``stock+ckpt`` (its own
checkpoint every iteration: ``torch.save`` for DDP, DCP for the others, synchronous
as such scripts write them); ``resihp`` (no checkpoints); ``resihp+ckpt`` (a checkpoint
every iteration). Each run's iteration time is its commit rate after ``WARMUP``
iterations (peers.summarise). Per round: the overhead ``resihp / stock - 1`` and the
fixed cost ``resihp - stock`` in ms per iteration; medians over rounds with the
min-max range. The cost of one checkpoint to the job is ``C = (X+ckpt) - X`` per
iteration (what the training path loses per checkpoint; for ResiHP's background writes
that is the copy and the seal's share of CPU, not the write), and at the Young/Daly
interval ``k = sqrt(2 C MTBF) / iteration`` (``--mtbf-s``, stated in the output) a
system's time per iteration is ``X + C / k``: the overhead with checkpoints compares
the two at their own intervals. Each run records the 1-minute load average and the
CPU that processes outside the benchmark took (``outside_cores``,
resihp_core.testing.outside_load): judge a few per cent only where both are low.

The stock side runs with glibc's heap settings (``STOCK_HEAP``) that torch_native's
``StepHeap`` applies to its own optimizer step, so no allocator gain is counted as
ResiHP's. The DeepSpeed job runs both sides with the environment's own settings: ResiHP's
DeepSpeed workers change nothing in the allocator.

Usage: python benchmarks/overhead.py [--quick] [--jobs dp4,pp2dp2,tp2pp2,ds_pp2dp2] [--sizes xs,s,m,l]
       [--rounds N] [--iterations N] [--systems stock,resihp] [--mtbf-s S] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402
from benchstats import loadavg, machine  # noqa: E402

#: the model sizes (resihp run's [model] section), peers.py's
SIZES = peers.SIZES
SYSTEMS = ("stock", "stock+ckpt", "resihp", "resihp+ckpt")


def run_order(systems: list[str], rnd: int) -> list[str]:
    """The order of round ``rnd``. With all four systems each run without checkpoints
    follows one with, of the other system, and the two swap every round: a run after
    a checkpointing run pays for its late disk writes and page reclaim (up to 25 % at
    size l after a stock run's GBs), so both sides pay it alike. Otherwise a rotation."""
    if sorted(systems) == sorted(SYSTEMS):
        a, b = ("stock", "resihp") if rnd % 2 == 0 else ("resihp", "stock")
        return [f"{a}+ckpt", b, f"{b}+ckpt", a]
    k = rnd % len(systems)
    return list(systems[k:]) + list(systems[:k])
#: The DeepSpeed user's GPT pipeline (``ds_gpt_train.py``), PP2 x DP2, 4 micro-batches
#: per replica; its model is ``SIZES[size]`` (blocks, width, heads, FFN, vocabulary).
DS_JOB = peers.Job("ds_pp2dp2", 2, 2, 4, adapter="deepspeed")
#: samples (of 16 tokens) per micro-batch: 64 tokens, as peers.py's pp2dp2 micro-batches
DS_MICRO_BATCH = 4
ALL_JOBS = {**peers.JOBS, DS_JOB.name: DS_JOB}
JOBS = ("dp4", "pp2dp2", "tp2pp2", DS_JOB.name)


#: glibc settings the stock side runs with: torch_native's ``StepHeap`` keeps the
#: optimizer's host temporaries on the heap, which any CPU script gets from these
#: variables; the comparison credits ResiHP with none of that allocator gain.
STOCK_HEAP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1)}


@contextlib.contextmanager
def _stock_heap() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in STOCK_HEAP}
    os.environ.update(STOCK_HEAP)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- the DeepSpeed job
DS_SCRIPT = HERE / "ds_gpt_train.py"

#: ``resihp launch`` reads this accelerate config (accelerate's own parser), as a user's.
DS_ACCELERATE = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: ds_config.json
  zero3_init_flag: false
num_machines: 1
num_processes: {workers}
machine_rank: 0
main_training_function: main
rdzv_backend: static
same_network: true
main_process_port: {port}
"""


def ds_config(job: peers.Job, iterations: int, checkpoint_every: int) -> dict:
    """The job's DeepSpeed JSON: batch, ZeRO 0, clipping, and its ``resihp`` section
    (read by ``resihp launch`` only; the stock script drops it)."""
    m, mbs = job.microbatches, DS_MICRO_BATCH
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": m,
            "train_batch_size": mbs * m * job.dp, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
            "zero_optimization": {"stage": 0}, "wall_clock_breakdown": False,
            "resihp": {"num_layers": int(peers.MODEL["layers"]) + 2, "pp": job.pp, "iterations": iterations,
                       "timeout_s": peers.TIMEOUT_S, "checkpoint_every": checkpoint_every}}


def ds_script_args(model: dict) -> list[str]:
    """``ds_gpt_train.py``'s model arguments for ``model`` (a ``SIZES`` entry)."""
    return ["--blocks", str(model["layers"]), "--hidden", str(model["hidden"]), "--heads", str(model["heads"]),
            "--ffn", str(model["ffn_hidden"]), "--vocab", str(model["vocab"])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``resihp launch``'s console line for a committed iteration (console_observer)
_COMMITTED = re.compile(r"^iteration\s+(\d+)\s+loss (\S+)")


def _stamped(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float, log: Path
             ) -> tuple[int | None, list[tuple[float, str]]]:
    """Run ``cmd`` in its own session, stamping each output line with ``time.time()``
    as it arrives (also copied to ``log``); past ``timeout`` the session this started
    is killed and the exit code is None."""
    p = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
    timer.start()
    lines: list[tuple[float, str]] = []
    try:
        with open(log, "w") as out:
            assert p.stdout is not None
            for line in p.stdout:
                lines.append((time.time(), line.rstrip("\n")))
                out.write(line)
        rc = p.wait()
    finally:
        timer.cancel()
        if p.poll() is None:
            kill()
            p.wait()
    return (None if expired.is_set() else rc), lines


def run_ds_resihp(job: peers.Job, iterations: int, work: Path, timeout: float, checkpoint_every: int) -> peers.Run:
    """The DeepSpeed job through ``resihp launch`` (controller, agents, supervisor,
    the commit protocol): each iteration's commit is the console line the controller
    prints for it."""
    (work / "ds_config.json").write_text(json.dumps(ds_config(job, iterations, checkpoint_every)))
    (work / "accelerate.yaml").write_text(DS_ACCELERATE.format(workers=job.workers, port=_free_port()))
    (work / "out").mkdir()
    cmd = [str(Path(sys.executable).parent / "resihp"), "launch", "--config_file", "accelerate.yaml",
           "--workdir", str(work / "run"), "--timeout", str(int(timeout)), str(DS_SCRIPT),
           "--out", str(work / "out"), *ds_script_args(peers.MODEL)]
    env = dict(peers._env())
    env.pop("RESIHP_CONFIG", None)
    run = peers.Run("resihp", job.name, "", extra={"checkpoint_every": checkpoint_every})
    t0 = time.time()
    rc, lines = _stamped(cmd, work, env, timeout + 60, work / "console.txt")
    run.wall_s = time.time() - t0
    batch = job.batch * DS_MICRO_BATCH
    committed = [(t, m) for t, line in lines if (m := _COMMITTED.match(line))]
    run.commits = [peers.Commit(int(m.group(1)), t, batch) for t, m in committed]
    run.extra["losses"] = {int(m.group(1)): float(m.group(2)) for _, m in committed}
    if rc != 0:
        run.ok = False
        run.error = (f"timed out after {timeout:.0f} s" if rc is None else f"resihp launch exited {rc}") + "; " + \
            " | ".join(x for _, x in lines[-4:])
    return run


def run_ds_stock(system: str, job: peers.Job, iterations: int, work: Path, timeout: float) -> peers.Run:
    """The same script with ``--stock`` under ``torchrun``: plain DeepSpeed; ``ckpt``
    writes DeepSpeed's own checkpoint after every step."""
    (work / "ds_config.json").write_text(json.dumps(ds_config(job, iterations, 0)))
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(job.workers),
           "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"overhead-ds-{os.getpid()}", str(DS_SCRIPT), "--stock", "--config",
           str(work / "ds_config.json"), "--out", str(work), "--iterations", str(iterations),
           *ds_script_args(peers.MODEL), *(["--save-dir", str(work / "ckpt")] if system == "ckpt" else [])]
    run = peers.Run(system, job.name, "", extra={"checkpoint_every": 1 if system == "ckpt" else 0})
    t0 = time.time()
    rc, lines = _stamped(cmd, work, dict(peers._env()), timeout, work / "torchrun.log")
    run.wall_s = time.time() - t0
    run.commits = peers._read_commits([work / "commits.txt"])
    with contextlib.suppress(OSError, ValueError):
        run.extra["losses"] = {int(i): float(x) for i, x in
                               (line.split() for line in (work / "losses.txt").read_text().splitlines())}
    if rc != 0:
        run.ok = False
        run.error = (f"timed out after {timeout:.0f} s" if rc is None else f"torchrun exited {rc}") + "; " + \
            peers._tail([work / "torchrun.log"])
    return run


def one_run(system: str, job: peers.Job, iterations: int, root: Path, timeout: float) -> dict:
    """One fault-free run: its iteration time, noise, load and outside CPU."""
    from resihp_core.testing.outside_load import OutsideLoad

    from fault_free_profile import CpuSampler

    work = Path(tempfile.mkdtemp(prefix=f"{system.replace('+', '-')}-{job.name}-", dir=root))
    outside = OutsideLoad()
    load0 = loadavg()
    outside.sample()
    cpu = CpuSampler()
    try:
        if job.adapter == "deepspeed":
            run = (run_ds_resihp(job, iterations, work, timeout, 1 if system.endswith("ckpt") else 0)
                   if system.startswith("resihp") else
                   run_ds_stock("ckpt" if system.endswith("ckpt") else "plain", job, iterations, work, timeout))
        elif system.startswith("resihp"):
            run = peers.run_resihp(job, [], iterations, work, timeout, 1 if system.endswith("ckpt") else 0)
        else:
            spec = peers.job_spec_json(job, iterations, work)
            with _stock_heap():
                run = peers.run_torchrun("ckpt" if system.endswith("ckpt") else "plain", job, [], iterations, work,
                                         spec, timeout, 1, 0)
    except Exception as e:  # noqa: BLE001 - a system that cannot run is a result, reported as such
        run = peers.Run(system, job.name, "none", ok=False, error=f"{type(e).__name__}: {e}"[:300])
    outside.sample()
    cpu.roles()  # stops the sampler
    s = peers.summarise(run.commits, [], iterations, peers.WARMUP) if run.ok else {}
    it = s.get("iteration_s", math.nan)
    if run.ok and s.get("complete"):  # checkpoints of size l are GBs per run; a failed run keeps its logs
        shutil.rmtree(work, ignore_errors=True)
    # The kernel writes a checkpointing run's dirty pages back after it ended: finish that
    # here, or the next run (resihp right after stock+ckpt in every round) pays for it.
    os.sync()
    return {"system": system, "ok": bool(run.ok and s.get("complete")), "error": run.error,
            **({"losses": run.extra["losses"]} if "losses" in run.extra else {}),
            "iteration_s": it, "iteration_rse": s.get("iteration_rse", math.nan), "wall_s": round(run.wall_s, 1),
            "cpu_s_per_iteration": steady_cpu(cpu, run.commits) if run.ok else math.nan,
            "load": [load0, loadavg()], "outside_cores": round(outside.cores_used(), 3)}


def steady_cpu(cpu: object, commits: list) -> float:
    """CPU seconds per iteration that the job's processes (this one, which hosts
    ResiHP's controller, and all its descendants: launcher, agents, workers) took from
    the first commit after the warm-up to the last: the work each system does per
    iteration, much less sensitive to other processes' load than its wall time."""
    first: dict[int, float] = {}
    for c in sorted(commits, key=lambda c: c.t):
        first.setdefault(c.iteration, c.t)
    if peers.WARMUP not in first or len(first) < peers.WARMUP + 3:
        return math.nan
    t0, t1 = first[peers.WARMUP], max(first.values())
    n = sum(1 for i in first if i > peers.WARMUP)
    return sum(cpu.between(t0, t1).values()) / n


def _mr(xs: list[float]) -> dict:
    """Median and min-max range of the finite values."""
    v = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def young_daly(plain_s: float, ckpt_s: float, mtbf_s: float) -> tuple[float, int, float]:
    """``(C, k, time per iteration at k)``: the cost of one checkpoint to the job (the
    every-iteration run's extra time, >= 0), Young/Daly's interval in iterations and
    the resulting time per iteration ``plain + C / k``."""
    c = max(0.0, ckpt_s - plain_s)
    k = peers.ckpt_interval(max(c, 1e-6), mtbf_s, plain_s)
    return c, k, plain_s + c / k


def figures(runs: list[dict], mtbf_s: float) -> dict:
    """One job and size: per round (runs grouped by ``round``) the ratios and the fixed
    cost, then medians with ranges."""
    by_round: dict[int, dict[str, float]] = {}
    cpu_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["ok"]:
            by_round.setdefault(r["round"], {})[r["system"]] = r["iteration_s"]
            cpu_round.setdefault(r["round"], {})[r["system"]] = r.get("cpu_s_per_iteration", math.nan)
    cpu_over: list[float] = []
    cpu_fixed: list[float] = []
    over, fixed, over_ck1, over_ck1_own, over_yd, ks, cs = [], [], [], [], [], {"stock": [], "resihp": []}, \
        {"stock": [], "resihp": []}
    for rnd, sysmap in by_round.items():
        st, rs = sysmap.get("stock"), sysmap.get("resihp")
        stc, rsc = sysmap.get("stock+ckpt"), sysmap.get("resihp+ckpt")
        if st and rs:
            over.append(100 * (rs / st - 1))
            fixed.append(1000 * (rs - st))
        cst, crs = cpu_round.get(rnd, {}).get("stock"), cpu_round.get(rnd, {}).get("resihp")
        if cst and crs and math.isfinite(cst) and math.isfinite(crs):
            cpu_over.append(100 * (crs / cst - 1))
            cpu_fixed.append(1000 * (crs - cst))
        if st and rsc:
            over_ck1.append(100 * (rsc / st - 1))
        if stc and rsc:
            over_ck1_own.append(100 * (rsc / stc - 1))
        if st and rs and stc and rsc:
            c_s, k_s, t_s = young_daly(st, stc, mtbf_s)
            c_r, k_r, t_r = young_daly(rs, rsc, mtbf_s)
            over_yd.append(100 * (t_r / t_s - 1))
            ks["stock"].append(k_s)
            ks["resihp"].append(k_r)
            cs["stock"].append(1000 * c_s)
            cs["resihp"].append(1000 * c_r)
    per_system = {s: _mr([r["iteration_s"] for r in runs if r["system"] == s and r["ok"]]) for s in SYSTEMS}
    # Where the runs logged their losses (the DeepSpeed job): the largest relative
    # difference of any run's loss from the stock run's of its round, same iteration.
    loss_diff = []
    for rnd in by_round:
        base = next((r.get("losses") for r in runs if r["round"] == rnd and r["system"] == "stock" and r["ok"]), None)
        for r in runs:
            if base and r["round"] == rnd and r["ok"] and r["system"] != "stock" and r.get("losses"):
                loss_diff += [abs(v - base[i]) / max(abs(base[i]), 1e-30) for i, v in r["losses"].items() if i in base]
    return {
        "iteration_s": per_system,
        "overhead_pct": _mr(over),
        "fixed_ms_per_iteration": _mr(fixed),
        "cpu_s_per_iteration": {s: _mr([r.get("cpu_s_per_iteration", math.nan) for r in runs
                                        if r["system"] == s and r["ok"]]) for s in SYSTEMS},
        "cpu_overhead_pct": _mr(cpu_over),
        "cpu_fixed_ms_per_iteration": _mr(cpu_fixed),
        "overhead_ckpt_every_iteration_vs_stock_pct": _mr(over_ck1),
        "overhead_ckpt_every_iteration_vs_stock_ckpt_pct": _mr(over_ck1_own),
        "checkpoint_cost_ms": {s: _mr(v) for s, v in cs.items()},
        "young_daly_every": {s: _mr(v) for s, v in ks.items()},
        "overhead_young_daly_pct": _mr(over_yd),
        "load": [min(x for r in runs for x in (r["load"][0] or [math.nan])[:1]),
                 max(x for r in runs for x in (r["load"][1] or [math.nan])[:1])],
        "outside_cores_max": max((r["outside_cores"] for r in runs), default=math.nan),
        "failed": [f"{r['system']} round {r['round']}: {r['error'][:120]}" for r in runs if not r["ok"]],
        "loss_max_rel_diff_vs_stock": max(loss_diff) if loss_diff else None,
    }


def _txt(m: dict, fmt: str = "{:.1f}") -> str:
    if not m["n"]:
        return "-"
    if m["n"] == 1:
        return fmt.format(m["median"])
    return f"{fmt.format(m['median'])} [{fmt.format(m['min'])} .. {fmt.format(m['max'])}]"


def markdown(rows: list[dict], mtbf_s: float, rounds: int) -> str:
    lines = [f"Fault-free overhead against the stock framework: medians over {rounds} alternating round(s), "
             f"[min .. max]; checkpoint interval by Young/Daly for an MTBF of {mtbf_s:.0f} s.", "",
             "| job | size | stock s/it | overhead % | fixed ms/it | CPU overhead % | fixed CPU ms/it | "
             "ckpt every it % (vs stock) | Young/Daly k (stock, resihp) | overhead at Young/Daly % | load | "
             "outside cores |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        f = r["figures"]
        k = f"{_txt(f['young_daly_every']['stock'], '{:.0f}')}, {_txt(f['young_daly_every']['resihp'], '{:.0f}')}"
        lines.append(f"| {r['job']} | {r['size']} | {_txt(f['iteration_s']['stock'], '{:.3f}')} | "
                     f"{_txt(f['overhead_pct'])} | {_txt(f['fixed_ms_per_iteration'])} | "
                     f"{_txt(f['cpu_overhead_pct'])} | {_txt(f['cpu_fixed_ms_per_iteration'], '{:.0f}')} | "
                     f"{_txt(f['overhead_ckpt_every_iteration_vs_stock_pct'])} | {k} | "
                     f"{_txt(f['overhead_young_daly_pct'])} | {f['load'][0]:.1f}-{f['load'][1]:.1f} | "
                     f"{f['outside_cores_max']:.2f} |")
    lines += ["", "CPU columns: CPU seconds per iteration of all the job's processes (controller, agents, "
              "launcher, workers) in the steady state, ResiHP against stock; less sensitive to other "
              "processes' load than the wall-clock columns.",
              "", "Targets (issue 35): with iterations >= 0.5 s, overhead <= 3 % without checkpoints and <= 5 % "
              "with a checkpoint every iteration, on a quiet machine (outside cores near 0)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized: dp4, size xs, 2 rounds, 14 iterations")
    ap.add_argument("--jobs", help=f"comma-separated of {', '.join(JOBS)} (default all; dp4 with --quick)")
    ap.add_argument("--sizes", help=f"comma-separated of {', '.join(SIZES)} (default all; xs with --quick)")
    ap.add_argument("--rounds", type=int, help="alternating rounds (default 5; 2 with --quick)")
    ap.add_argument("--iterations", type=int, help="iterations per run (default 25; 14 with --quick)")
    ap.add_argument("--mtbf-s", type=float, default=3600.0, help="the job's MTBF for Young/Daly (default 1 h)")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a run counts as stuck")
    ap.add_argument("--systems", help=f"comma-separated of {', '.join(SYSTEMS)} (default all): e.g. "
                                      "stock,resihp for the cost without checkpoints alone")
    ap.add_argument("--json", help="write every run and figure here")
    args = ap.parse_args(argv)
    jobs = (args.jobs or ("dp4" if args.quick else ",".join(JOBS))).split(",")
    sizes = (args.sizes or ("xs" if args.quick else ",".join(SIZES))).split(",")
    for name, known in (("--jobs", JOBS), ("--sizes", SIZES)):
        bad = [x for x in (jobs if name == "--jobs" else sizes) if x not in known]
        if bad:
            ap.error(f"{name}: unknown {bad} (known: {', '.join(known)})")
    systems = tuple(args.systems.split(",")) if args.systems else SYSTEMS
    if set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(set(systems) - set(SYSTEMS))} (known: {', '.join(SYSTEMS)})")
    rounds = args.rounds or (2 if args.quick else 5)
    iterations = args.iterations or (14 if args.quick else 25)
    if iterations <= peers.WARMUP + 2:
        ap.error(f"--iterations must exceed {peers.WARMUP + 2} (the first {peers.WARMUP} are warm-up)")
    root = Path(tempfile.mkdtemp(prefix="resihp-overhead-"))
    t0 = time.time()
    rows = []
    for size in sizes:
        peers.MODEL = dict(SIZES[size])  # resihp_config and the stock scripts' spec read it
        for jname in jobs:
            job = ALL_JOBS[jname]
            runs = []
            for rnd in range(rounds):
                order = run_order(systems, rnd)
                for system in order:
                    r = one_run(system, job, iterations, root, args.run_timeout)
                    r["round"] = rnd
                    runs.append(r)
                    print(f"{jname} {size} round {rnd} {system}: "
                          f"{'%.4f s/it' % r['iteration_s'] if r['ok'] else 'FAILED ' + r['error'][:200]} "
                          f"(load {r['load'][1][0] if r['load'][1] else '?'}, outside {r['outside_cores']:.2f} cores)",
                          flush=True)
            rows.append({"job": jname, "size": size, "layout": job.layout, "adapter": job.adapter,
                         "model": SIZES[size], "figures": figures(runs, args.mtbf_s), "runs": runs})
            diff = rows[-1]["figures"]["loss_max_rel_diff_vs_stock"]
            if diff is not None:
                print(f"{jname} {size}: every run's loss per iteration within {diff:.1e} (relative) of the stock "
                      "run's in its round (the same model, data and seeds)", flush=True)
    md = markdown(rows, args.mtbf_s, rounds)
    print()
    print(md)
    failed = [f for r in rows for f in r["figures"]["failed"]]
    if failed:
        print("\nfailed runs: " + "; ".join(failed))
    if args.json:
        summary = {f"{r['job']}-{r['size']}": {
            "stock_s": r["figures"]["iteration_s"]["stock"]["median"],
            "overhead_pct": r["figures"]["overhead_pct"]["median"],
            "fixed_ms": r["figures"]["fixed_ms_per_iteration"]["median"],
            "cpu_overhead_pct": r["figures"]["cpu_overhead_pct"]["median"],
            "cpu_fixed_ms": r["figures"]["cpu_fixed_ms_per_iteration"]["median"],
            "ckpt_every_it_pct": r["figures"]["overhead_ckpt_every_iteration_vs_stock_pct"]["median"],
            "young_daly_pct": r["figures"]["overhead_young_daly_pct"]["median"]} for r in rows}
        loads = [x for r in rows for run in r["runs"] for pair in run["load"] if pair for x in pair[:1]]
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                       "load": [min(loads), max(loads)] if loads else None,
                       "outside_cores_max": max((r["figures"]["outside_cores_max"] for r in rows), default=None),
                       # each run's relative standard error of its commit gaps, median over runs
                       "noise_iteration_rse": _mr([run["iteration_rse"] for r in rows for run in r["runs"]])["median"],
                       "quick": args.quick, "rounds": rounds, "iterations": iterations, "mtbf_s": args.mtbf_s,
                       "machine": machine(), "wall_s": round(time.time() - t0, 1), "summary": summary,
                       "rows": rows, "markdown": md}, f, indent=1, default=str)
    try:
        root.rmdir()  # left only where a failed run kept its logs
    except OSError:
        print(f"logs of the failed runs are under {root}")
    ok = all(r["figures"]["overhead_pct"]["n"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
