"""CPU per iteration of the torch_native engine against peers.py's plain DDP step, in
one process (world of 1, gloo, the peers' dp4 model and data, float64): the in-process
part of the fault-free gap, without agents, the controller, the commit protocol or
other workers competing for the 2 cores (docs/benchmarks.md, "Session 11").

The engine's iteration is what a ResiHP worker runs per iteration (the rollback
snapshot, then ``run``: the pipeline runtime, FSDP2, the optimizer step); the DDP step
is peers.py's plain script. Their difference reproduces the dp4 workers' per-worker CPU
gap of ``reconfigure.py --fault-free-job dp4`` in one process. Run it with another
checkout first on PYTHONPATH for an A/B of engine changes at the same load.

Usage: python benchmarks/engine_cpu.py [--iterations N] [--rounds R] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import resihp_adapters
    from resihp_core.job import JobSpec
    from resihp_core.plan import ParallelPlan
    from resihp_core.predictor.schedules import emit_programs
    from resihp_adapters.torch_native.data import Batches, job_source
    from resihp_adapters.torch_native.engine import TorchNativeEngine
    from resihp_adapters.torch_native.model import LlamaConfig, build_stage, loss_sum

    torch.set_num_threads(1)
    m = 3  # the dp4 job's micro-batches per replica (peers.JOBS["dp4"])
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, ffn_dim=128, dtype="float64")
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 64},
                  dp=1, num_microbatches=m)
    data = Batches(job_source(job, 256), torch.float64)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    eng = TorchNativeEngine(0, cfg, data, dist.HashStore(), shard_degree=1, lr=0.01, weight_decay=0.0)
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=4, num_microbatches=m)
    eng.rebuild(plan, 0, [0])
    eng.start_fresh()
    eng.keep_snapshots(2)  # as the worker's overlapped commit keeps them
    prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(0, 0)]
    model = build_stage(cfg, 0, cfg.n_layers)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0, foreach=False)
    it = [0]

    def engine() -> None:
        eng.snapshot()
        eng.run(prog, it[0])
        it[0] += 1

    def plain() -> None:  # peers.py's plain DDP step
        i = it[0]
        it[0] += 1
        denom = float(sum(data.micro_batch(i, 0, j, m).labels.ne(-100).sum() for j in range(m)))
        for j in range(m):
            mb = data.micro_batch(i, 0, j, m)
            with ddp.no_sync() if j < m - 1 else contextlib.nullcontext():
                (loss_sum(ddp(mb.tokens, **mb.kwargs()), mb.labels) / denom).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def cpu_ms(fn) -> float:
        for _ in range(3):
            fn()
        t0 = time.process_time()
        for _ in range(args.iterations):
            fn()
        return 1e3 * (time.process_time() - t0) / args.iterations

    rounds = []
    for r in range(args.rounds):
        a, b = cpu_ms(engine), cpu_ms(plain)
        rounds.append({"engine_ms": a, "ddp_ms": b, "load": os.getloadavg()[0]})
        print(f"round {r + 1}: engine {a:.2f} ms CPU/it, plain DDP {b:.2f}, difference {a - b:+.2f}; "
              f"load {os.getloadavg()[0]:.1f}")
    med = {k: statistics.median(x[k] for x in rounds) for k in ("engine_ms", "ddp_ms")}
    print(f"median: engine {med['engine_ms']:.2f}, plain DDP {med['ddp_ms']:.2f} ms CPU/it "
          f"({os.path.dirname(resihp_adapters.__file__)})")
    eng.release()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "median": med, "tree": os.path.dirname(resihp_adapters.__file__)}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
