"""What one torch_native DCP checkpoint write costs each rank of peers.py's dp4 job
(PP1 x DP4 HSDP, shard 1, the peers' model), wall and CPU seconds per save, three ways
in the same processes, alternated: ``old`` (every replica writes, one DCP entry per
optimizer hyper-parameter value: the code before session 10), ``all`` (every replica,
hyper-parameters packed per parameter) and ``one`` (packed, replicate index 0 alone
writes: what the engine does now). docs/benchmarks.md, "Where a fault-free iteration
goes".

Usage: python benchmarks/dcp_write_cost.py [--saves N] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("old", "all", "one")


def _rank(dev: int, port: int, out: str, saves: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from resihp_core.job import JobSpec
    from resihp_core.plan import ParallelPlan
    from resihp_core.predictor.schedules import emit_programs
    from resihp_adapters.torch_native.data import Batches, job_source
    from resihp_adapters.torch_native.engine import TorchNativeEngine
    from resihp_adapters.torch_native.model import LlamaConfig

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, ffn_dim=128)  # peers.MODEL
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 64},
                  dp=4, num_microbatches=3)
    eng = TorchNativeEngine(dev, cfg, Batches(job_source(job, 256), cfg.torch_dtype), store, shard_degree=1,
                            timeout_s=60)
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=4, num_layers=4, num_microbatches=3)
    eng.rebuild(plan, 0)
    eng.start_fresh()
    prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(eng.place.replica, eng.place.stage)]
    for i in range(2):
        eng.run(prog, i)
    group, writes = eng.checkpoint_group, eng.writes_checkpoint

    def old(path: str) -> None:
        eng._ensure_optimizer_state()
        dcp.save(eng._state_dicts(), checkpoint_id=path, process_group=eng.executors_group)

    res: dict[str, list] = {m: [] for m in MODES}
    for rnd in range(saves):
        for mode in MODES[rnd % 3:] + MODES[:rnd % 3]:
            eng.checkpoint_group, eng.writes_checkpoint = (None, True) if mode == "all" else (group, writes)
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            (old if mode == "old" else eng.save_checkpoint)(os.path.join(out, f"{mode}{rnd}"))
            res[mode].append((time.perf_counter() - t, time.process_time() - c))
            dist.barrier()
    eng.checkpoint_group, eng.writes_checkpoint = group, writes
    with open(os.path.join(out, f"r{dev}.json"), "w") as f:
        json.dump(res, f)
    eng.release()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_rank":
        _rank(int(argv[1]), int(argv[2]), argv[3], int(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=6, help="saves of each kind (alternated)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    import torch.distributed as dist

    out = tempfile.mkdtemp(prefix="resihp-dcp-cost-")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load0 = os.getloadavg()[0]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_rank", str(d), str(store.port), out,
                               str(args.saves)], env=env, stderr=subprocess.DEVNULL) for d in range(4)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:  # by pid, only what this script started
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        print(f"a rank failed: exit codes {codes}", file=sys.stderr)
        return 1
    load = [load0, os.getloadavg()[0]]
    per = [json.load(open(os.path.join(out, f"r{d}.json"))) for d in range(4)]
    table = {}
    print(f"DCP save of peers.py's dp4 state (PP1 x DP4 HSDP), {args.saves} saves of each kind alternated, "
          f"median per save; load (1 min) {load[0]:.1f}-{load[1]:.1f}")
    print("| kind | wall s (rank 0) | CPU s, 4 ranks summed | CPU s by rank |\n| --- | --- | --- | --- |")
    for m in MODES:
        cpu = [statistics.median(c for _, c in r[m]) for r in per]
        wall = statistics.median(w for w, _ in per[0][m])
        table[m] = {"wall_s": wall, "cpu_s": sum(cpu), "cpu_s_by_rank": cpu}
        print(f"| {m} | {wall:.3f} | {sum(cpu):.3f} | {' '.join(f'{x:.3f}' for x in cpu)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"saves": args.saves, "load": load, "kinds": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
