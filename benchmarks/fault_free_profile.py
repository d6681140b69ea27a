"""Where a fault-free ResiHP iteration goes (torch_native): each worker's main thread
under ``cProfile`` (wall clock) during one fault-free run of peers.py's job through
``resihp run``'s production path, per-iteration milliseconds by part, and the CPU
seconds of every process of the job (controller, agent, workers).

cProfile's own overhead inflates Python-heavy parts (the DTensor optimizer step, the
pipeline runtime) more than waits and C++ compute: read the table for where the time
goes, and the fault-free ratios of peers.py / reconfigure.py for what it costs
(docs/benchmarks.md, "Where a fault-free iteration goes").

``--stock --job ds_pp2dp2`` profiles overhead.py's DeepSpeed job instead (the user's GPT
pipeline under ``resihp launch`` and the same script on plain DeepSpeed under torchrun)
and adds the cumulative time per iteration of each part of ResiHP's DeepSpeed iteration
(``DS_PARTS``); ``--size`` takes overhead.py's model sizes.

Usage: python benchmarks/fault_free_profile.py [--job dp4|pp2dp2|ds_pp2dp2] [--size xs|s|m|l]
       [--iterations N] [--checkpoint-every K] [--json PATH]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

# Started in every worker (RESIHP_JOB and RESIHP_DEVICE set) through a sitecustomize
# on the workers' PYTHONPATH: profile the main thread, dump the stats at exit.
# With RESIHP_PROFILE_CLOCK=thread the profiler's clock is the main thread's CPU time
# (time.thread_time): waits for a core or a peer count nothing, so the table reads as
# work done per iteration, much less sensitive to the host's load. Stock torchrun
# workers (RANK, LOCAL_RANK set) are profiled too (``--stock``).
_SITECUSTOMIZE = '''
import os
_ID = (os.environ.get("RESIHP_DEVICE") if os.environ.get("RESIHP_JOB") else None) or (
    "stock" + os.environ["RANK"] if os.environ.get("RANK") and os.environ.get("LOCAL_RANK") is not None else None)
if os.environ.get("RESIHP_PROFILE_DIR") and _ID is not None:
    import atexit, cProfile, time
    _p = cProfile.Profile(time.thread_time) if os.environ.get("RESIHP_PROFILE_CLOCK") == "thread" else cProfile.Profile()
    _after = int(os.environ.get("RESIHP_PROFILE_AFTER", "0") or 0)
    if _after <= 0:
        _p.enable()
    else:  # the steady state only: from the end of optimizer step _after on
        import torch.optim.optimizer as _o
        _n = [0]
        def _hook(opt, args, kwargs):
            _n[0] += 1
            if _n[0] == _after:
                _p.enable()
        _o.register_optimizer_step_post_hook(_hook)
    def _dump():
        _p.disable()
        _p.dump_stats(os.path.join(os.environ["RESIHP_PROFILE_DIR"], f"worker{_ID}-{os.getpid()}.prof"))
    atexit.register(_dump)
    _exit = os._exit
    def _dump_and_exit(code):  # peers.py's torchrun workers leave by os._exit: no atexit
        _dump()
        _exit(code)
    os._exit = _dump_and_exit
'''

# (row, file suffix, function): cumulative wall time of that function per iteration.
PARTS = [
    ("iteration in the worker (Worker._one_iteration, _overlapped_iteration, _deferred_iteration)",
     "runtime/worker/__init__.py", "_one_iteration|_overlapped_iteration|_deferred_iteration"),
    ("  adapter.run_iteration", "torch_native/adapter.py", "run_iteration"),
    ("    pipeline schedule: forward, backward, FSDP collectives", "pipelining/schedules.py", "_step_microbatches"),
    ("    one-stage program (pp = 1): the engine's own loop", "torch_native/engine.py", "_step_microbatches"),
    ("      its forward and backward chunks", "torch_native/engine.py", "chunk"),
    ("      forward and backward chunks", "pipelining/stage.py", "forward_one_chunk|backward_one_chunk|"
     "backward_weight_one_chunk"),
    ("      FSDP post-backward (the gradient reduction where sharded)", "pipelining/stage.py",
     "perform_reduce_grad"),
    ("      replica buckets' copy-in (shard degree 1, inside backward)", "torch_native/replica_reduce.py", "_copy"),
    ("    replica buckets' wait, gradients set", "torch_native/replica_reduce.py", "finish"),
    ("    optimizer step (AdamW on DTensors)", "optim/optimizer.py", "wrapper"),
    ("  snapshot for rollback", "torch_native/adapter.py", "snapshot"),
    ("  next iteration's snapshot after the step, SDC fingerprint read in its copy", "torch_native/adapter.py",
     "snapshot_fingerprint"),
    ("  SDC fingerprint and range signals (sent with the commit)", "detector/sdc.py", "prepare"),
    ("    the adapter's fingerprint pass", "torch_native/adapter.py", "fingerprint"),
    ("  checkpoint: the training thread's share", "torch_native/adapter.py", "save_checkpoint"),
    ("  checkpoint status, seal", "runtime/worker/__init__.py", "_checkpoint_reports"),
    ("  iteration report to the store", "runtime/session.py", "put_report"),
    ("  commit: count + verdict", "runtime/session.py", "commit"),
    ("  commit before the step: count + verdict (through the node agent)", "runtime/worker/__init__.py", "_commit"),
    ("    the deciding executor's comparison of fingerprints", "detector/sdc.py", "check"),
    ("  the step after the commit (optimizer step)", "torch_native/adapter.py", "apply_step"),
    ("  profile to the detector (queued)", "runtime/heartbeat.py", "send_profile"),
    ("superseded check between iterations", "runtime/worker/__init__.py", "_superseded"),
]


# The DeepSpeed job's parts (``--stock --job ds_pp2dp2``): cumulative time per iteration.
DS_PARTS = [
    ("the script's train_batch (ResiHP's handle, api.py)", "deepspeed/api.py", "train_batch"),
    ("  worker iteration (Worker._one_iteration)", "runtime/worker/__init__.py", "_one_iteration"),
    ("    rollback snapshot", "deepspeed/adapter.py", "snapshot"),
    ("    adapter.run_iteration", "deepspeed/adapter.py", "run_iteration"),
    ("      DeepSpeed's PipelineEngine.train_batch (stock: the script's call)", "pipe/engine.py", "train_batch"),
    ("      forward passes", "pipe/engine.py", "_exec_forward_pass"),
    ("      backward passes", "pipe/engine.py", "_exec_backward_pass"),
    ("      data-parallel and tied reductions", "pipe/engine.py", "_exec_reduce_grads|_exec_reduce_tied_grads"),
    ("      gradient clipping (norm gathered)", "deepspeed/engine.py|runtime/engine.py", "clip_fp32_gradients"),
    ("      optimizer step", "pipe/engine.py", "_exec_optimizer_step"),
    ("      commit point (sends drained, hook)", "deepspeed/engine.py", "_exec_commit_point"),
    ("      waits in helper threads (p2p_wait)", "deepspeed/engine.py", "p2p_wait"),
    ("    profile, checkpoint, SDC post, report (_before_commit)", "runtime/worker/__init__.py", "_before_commit"),
    ("      SDC fingerprint", "deepspeed/adapter.py", "fingerprint"),
    ("      profile to the detector", "runtime/heartbeat.py", "send_profile"),
    ("    commit: report + verdict", "runtime/worker/__init__.py", "_commit"),
    ("  the committed loss read back (stages before the last)", "deepspeed/idle.py", "committed_loss"),
]


def _cum(st: pstats.Stats, suffix: str, fns: str) -> tuple[float, int]:
    """Cumulative seconds of the functions ``fns`` ('|'-separated) of files ending in
    ``suffix``, and the most calls of any of them."""
    names = set(fns.split("|"))
    suffixes = tuple(suffix.split("|"))
    tot, calls = 0.0, 0
    for (f, _line, name), (_cc, nc, _tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        if f.endswith(suffixes) and name in names:
            tot += ct
            calls = max(calls, nc)
    return tot, calls


def breakdown(folder: Path) -> tuple[list[tuple[str, float, list[float]]], int]:
    files = sorted(glob.glob(str(folder / "*.prof")))
    if not files:
        raise RuntimeError(f"no worker profiles in {folder} (did the workers exit normally?)")
    rows: dict[str, list[float]] = {r[0]: [] for r in PARTS}
    iterations = 0
    for f in files:
        st = pstats.Stats(f)
        # begin_iteration: once per iteration, commit in line or overlapped
        iterations = _cum(st, "runtime/worker/__init__.py", "begin_iteration")[1]
        for label, suffix, fn in PARTS:
            rows[label].append(1e3 * _cum(st, suffix, fn)[0] / max(1, iterations))
    return [(k, statistics.median(v), v) for k, v in rows.items()], iterations


class CpuSampler:
    """CPU seconds of this process and its descendants, by role (last reading of each,
    and a series of readings to take the steady state between two times)."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[float, str]] = {}
        self.series: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._hz = os.sysconf("SC_CLK_TCK")
        threading.Thread(target=self._run, daemon=True).start()

    def _tree(self) -> list[int]:
        kids: dict[int, list[int]] = {}
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    st = open(f"/proc/{p}/stat").read()
                    kids.setdefault(int(st[st.rindex(")") + 2:].split()[1]), []).append(int(p))
                except (OSError, ValueError, IndexError):
                    pass
        out, todo = [], [os.getpid()]
        while todo:
            x = todo.pop()
            out.append(x)
            todo += kids.get(x, [])
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            for p in self._tree():
                try:
                    st = open(f"/proc/{p}/stat").read()
                    f = st[st.rindex(")") + 2:].split()
                    cmd = open(f"/proc/{p}/cmdline").read().replace("\0", " ")
                    if cmd:
                        self.last[p] = ((int(f[11]) + int(f[12])) / self._hz, cmd)
                except (OSError, ValueError, IndexError):
                    pass
            self.series.append((time.time(), self._roles()))

    def _roles(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p, (cpu, cmd) in list(self.last.items()):
            role = ("controller (store, supervisor, detector)" if p == os.getpid() else
                    "workers" if "runtime.processes" in cmd or "runtime.worker" in cmd else
                    "node agent" if "runtime.agent" in cmd else "other")
            out[role] = out.get(role, 0.0) + cpu
        return out

    def roles(self) -> dict[str, float]:
        self._stop.set()
        return self._roles()

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used from the last reading at or before ``t0`` to the
        last at or before ``t1`` (the steady state: start-up and exit left out)."""
        a = [r for t, r in self.series if t <= t0] or self.series[:1]
        b = [r for t, r in self.series if t <= t1] or self.series[-1:]
        lo, hi = a[-1], b[-1]
        return {k: hi[k] - lo.get(k, 0.0) for k in hi}


def per_function(files: list[str], iterations: int) -> dict[str, float]:
    """Own time (cProfile's tottime) per iteration per worker of every function, summed
    over ``files`` (one profile per worker) and divided by workers x ``iterations``: ms."""
    out: dict[str, float] = {}
    for f in files:
        st = pstats.Stats(f)
        for (path, line, name), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            key = f"{'/'.join(path.split('/')[-2:])}:{line}({name})"
            out[key] = out.get(key, 0.0) + 1e3 * tt / (len(files) * iterations)
    return out


def compare_stock(job: peers.Job, iterations: int, root: Path, prof: Path) -> dict:
    """One run of ResiHP (no checkpoints, commit overlapped) and one of the stock script
    (peers.py's ``plain``), every worker's main thread profiled on the same clock; the
    functions by own time per iteration per worker, both sides, largest difference
    first (what ResiHP adds, or saves, on the training thread)."""
    out: dict = {}
    spec = peers.job_spec_json(job, iterations, root / "spec")
    os.environ["RESIHP_PROFILE_AFTER"] = str(peers.WARMUP)  # start-up and warm-up left out
    for system in ("resihp", "stock"):
        d = prof / system
        d.mkdir()
        (root / system).mkdir()
        os.environ["RESIHP_PROFILE_DIR"] = str(d)
        load0 = os.getloadavg()[0]
        if job.adapter == "deepspeed":
            import overhead

            run = (overhead.run_ds_resihp(job, iterations, root / system, 600, 0) if system == "resihp" else
                   overhead.run_ds_stock("plain", job, iterations, root / system, 600))
        elif system == "resihp":
            run = peers.run_resihp(job, [], iterations, root / system, 600, 0)
        else:
            run = peers.run_torchrun("plain", job, [], iterations, root / system, spec, 600, 0, 0)
        if not run.ok:
            raise RuntimeError(f"the {system} run failed: {run.error}")
        files = sorted(glob.glob(str(d / "*.prof")))
        out[system] = {"functions": per_function(files, iterations - peers.WARMUP), "workers": len(files),
                       "load": [load0, os.getloadavg()[0]],
                       "iteration_s": peers.summarise(run.commits, [], iterations, peers.WARMUP)["iteration_s"]}
        if job.adapter == "deepspeed":
            out[system]["parts"] = {label: [1e3 * _cum(pstats.Stats(f), suffix, fn)[0] / (iterations - peers.WARMUP)
                                            for f in files] for label, suffix, fn in DS_PARTS}
    return out


def _print_compare(res: dict, clock: str, top: int = 25) -> None:
    if "parts" in res["resihp"]:
        print(f"cumulative {clock}-clock ms per iteration of each worker's main thread (median [min .. max] "
              f"over workers); commit gap resihp {res['resihp']['iteration_s']:.3f} s, "
              f"stock {res['stock']['iteration_s']:.3f} s")
        print("| part | resihp | stock |\n| --- | --- | --- |")
        for label, _suffix, _fn in DS_PARTS:
            cells = []
            for side in ("resihp", "stock"):
                v = [x for x in res[side]["parts"][label] if x > 0]
                cells.append(f"{statistics.median(v):.1f} [{min(v):.1f} .. {max(v):.1f}]" if v else "-")
            print(f"| {label.strip()} | {cells[0]} | {cells[1]} |")
        print()
    a, b = res["resihp"]["functions"], res["stock"]["functions"]
    ta, tb = sum(a.values()), sum(b.values())
    print(f"main thread, {clock} clock, ms per iteration per worker (all functions' own time): "
          f"resihp {ta:.2f}, stock {tb:.2f} ({100 * (ta / tb - 1):+.1f} %); loads "
          f"{res['resihp']['load']} / {res['stock']['load']}")
    diff = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0.0) - b.get(k, 0.0)))
    print("| function | resihp ms | stock ms | difference |\n| --- | --- | --- | --- |")
    for k in diff[:top]:
        print(f"| {k} | {a.get(k, 0.0):.3f} | {b.get(k, 0.0):.3f} | {a.get(k, 0.0) - b.get(k, 0.0):+.3f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="dp4", choices=[*sorted(peers.JOBS), "ds_pp2dp2"])
    ap.add_argument("--size", help="overhead.py's model size (xs, s, m, l); default: peers.py's model")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--checkpoint-every", type=int, default=3,
                    help="ResiHP's checkpoint interval (3: what peers.py --quick's Young/Daly picked)")
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="the profiler's clock: wall, or the main thread's CPU time (load-insensitive)")
    ap.add_argument("--stock", action="store_true",
                    help="profile a ResiHP run (no checkpoints) and the stock script's run of the job; "
                         "print the functions by difference in own time per iteration")
    args = ap.parse_args(argv)
    os.environ["RESIHP_PROFILE_CLOCK"] = args.clock
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(tempfile.mkdtemp(prefix="resihp-ffprof-"))
    site, prof = root / "site", root / "prof"
    site.mkdir()
    prof.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    os.environ["RESIHP_PROFILE_DIR"] = str(prof)
    if args.size or args.job == "ds_pp2dp2":
        import overhead

        if args.size:
            peers.MODEL = dict(overhead.SIZES[args.size])
        job = overhead.ALL_JOBS[args.job]
        if job.adapter == "deepspeed" and not args.stock:
            ap.error("--job ds_pp2dp2 runs with --stock (the side-by-side profile)")
    else:
        job = peers.JOBS[args.job]
    if args.stock:
        res = compare_stock(job, args.iterations, root, prof)
        _print_compare(res, args.clock)
        if args.json:
            Path(args.json).write_text(json.dumps({"job": args.job, "iterations": args.iterations,
                                                   "clock": args.clock, **res}, indent=2))
        return 0
    load0 = os.getloadavg()[0]
    cpu = CpuSampler()
    t0 = time.time()
    run = peers.run_resihp(job, [], args.iterations, root / "run", 600, args.checkpoint_every)
    wall = time.time() - t0
    roles = cpu.roles()
    load1 = os.getloadavg()[0]
    if not run.ok:
        print(f"the run failed: {run.error}", file=sys.stderr)
        return 1
    it_s = peers.summarise(run.commits, [], args.iterations, 3)["iteration_s"]
    rows, iterations = breakdown(prof)
    print(f"fault-free {args.job}, {args.iterations} iterations, checkpoint every {args.checkpoint_every}; "
          f"commit gap (median) {it_s:.3f} s; load (1 min) {load0:.1f} -> {load1:.1f}; wall {wall:.0f} s")
    print(f"per iteration, median over the {len(glob.glob(str(prof / '*.prof')))} workers "
          f"({iterations} iterations each, cProfile wall clock):")
    print("| part | ms / iteration | workers |\n| --- | --- | --- |")
    for label, med, per in rows:
        print(f"| {label.strip()} | {med:.1f} | {' '.join(f'{x:.1f}' for x in per)} |")
    print("\nCPU seconds of the whole run (start-up included), by process:")
    for k, v in sorted(roles.items()):
        print(f"  {k:45s} {v:7.2f}")
    t_first, t_last = run.commits[0].t, run.commits[-1].t
    steady = cpu.between(t_first, t_last)
    print(f"\nCPU seconds from the first to the last commit ({t_last - t_first:.1f} s wall), by process:")
    for k, v in sorted(steady.items()):
        print(f"  {k:45s} {v:7.2f}")
    ratio = steady.get("controller (store, supervisor, detector)", 0.0) / max(1e-9, steady.get("workers", 0.0))
    print(f"  controller / workers: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"job": args.job, "iterations": args.iterations,
                                               "checkpoint_every": args.checkpoint_every, "iteration_s": it_s,
                                               "rows": rows, "cpu_s": roles, "cpu_s_steady": steady,
                                               "controller_per_worker_cpu": ratio, "load": [load0, load1]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
