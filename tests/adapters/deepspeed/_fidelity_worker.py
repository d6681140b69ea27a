"""One rank of the fidelity check: stock ``deepspeed.initialize`` + ``train_batch``, then
(same processes, next world) ResiHP's engine on the same model and data; dumps losses,
``eval_batch`` on held-out micro-batches and per-layer parameters for the test to compare."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    import _model as M
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from resihp_adapters.deepspeed.data import MicroBatchSource
    from resihp_adapters.deepspeed.engine import plan_topology
    from resihp_adapters.deepspeed.world import build_engine, ds_config_for, init_world, prepare_deepspeed, teardown_world
    from resihp_core.plan import ParallelPlan
    from resihp_core.predictor.schedules import emit_programs

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = a.store.rsplit(":", 1)
    store = tdist.TCPStore(host, int(port), is_master=False, timeout=__import__("datetime").timedelta(seconds=60))
    prepare_deepspeed(20)
    layers = 6
    cfg = M.config(2, a.mb, a.dp)
    src = MicroBatchSource(M.Samples(), MicroBatchSource.default_collate, 2, a.mb, a.dp)
    out: dict = {}
    import gc

    gc.freeze()  # as the real worker does: the teardown between the two runs collects little

    # Stock DeepSpeed.
    init_world(store, 0, rank, world, 20)
    module = PipelineModule(M.layer_specs(layers), topology=PipeDataParallelTopology(a.pp, a.dp), loss_fn=M.mse,
                            seed_layers=True, base_seed=7, partition_method="uniform")
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    engine.communication_data_type = torch.float64  # as ResiHP's engine does for float64 models
    it = src.iterator(engine.grid.data_parallel_id)
    losses, times = [], []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        losses.append(float(engine.train_batch(it)))
        times.append(time.perf_counter() - t0)
    # DeepSpeed's eval_batch on held-out micro-batches (the same on both engines).
    held_out = [src.micro_batch(100, engine.grid.data_parallel_id, j) for j in range(a.mb)]
    evaluated = float(engine.eval_batch(iter(held_out)))
    out["stock"] = {"losses": losses, "times": times, "eval": evaluated,
                    "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}
    del engine, module, opt, it, _
    teardown_world()

    # ResiHP's engine, plan generation 1, same layout.
    plan = ParallelPlan.uniform(tp=1, pp=a.pp, dp=a.dp, num_layers=layers, num_microbatches=a.mb).with_(generation=1)
    init_world(store, 1, rank, world, 20)
    parts = [a for a, _ in plan.layer_ranges] + [layers]
    engine = build_engine(M.layer_specs(layers), parts=parts, topology=plan_topology(plan),
                          config=ds_config_for(cfg, micro_batch_size=2, num_microbatches=a.mb, replicas=a.dp),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), loss_fn=M.mse, base_seed=7)
    progs = {(p.replica, p.stage): p for p in emit_programs(plan)}
    engine.set_work(plan, progs[(engine.grid.data_parallel_id, engine.stage_id)], src)
    losses, times = [], []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        losses.append(float(engine.train_batch()))
        times.append(time.perf_counter() - t0)
    evaluated = float(engine.eval_batch(iter(held_out)))
    out["resihp"] = {"losses": losses, "times": times, "eval": evaluated,
                     "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}
    out["stage"], out["replica"] = engine.stage_id, engine.grid.data_parallel_id
    torch.save(out, os.path.join(a.out, f"rank{rank}.pt"))
    del engine
    teardown_world()


if __name__ == "__main__":
    main()
