"""One process of the fidelity test: the torch_native engine, then stock torch, same job.

Run as ``python torch_native_job.py SPEC.json DEVICE STORE_PORT``. The process first
trains ``iterations`` iterations of ``plan`` with the adapter's engine (the core's
programs lowered into torch's pipeline runtime, FSDP2 over each stage's replicas,
rendezvous under ``gen0/``), then the same job written the stock way
(:func:`~resihp_adapters.torch_native.reference.plain_pipeline_fsdp_run`: ``fully_shard``
+ ``PipelineStage`` + ``Schedule1F1B``/``ScheduleGPipe``) under ``plain/``. The lowest
replica of each stage writes both runs' full stage tensors; every process writes its
losses to ``DEVICE.json``. Both train on the same job data source (``spec['data']``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from resihp_core.data import create_source
from resihp_core.plan import parse_plan
from resihp_core.predictor.schedules import emit_programs
from resihp_adapters.torch_native.data import Batches
from resihp_adapters.torch_native.engine import TorchNativeEngine
from resihp_adapters.torch_native.model import LlamaConfig
from resihp_adapters.torch_native.reference import plain_pipeline_fsdp_run


def main(spec_path: str, device: int, port: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    cfg = LlamaConfig(**spec["model"])
    plan, iterations = parse_plan(spec["plan"]), spec["iterations"]
    source = create_source(spec["data"], dp=plan.dp, num_microbatches=plan.num_microbatches, seed=0,
                           vocab_size=cfg.vocab_size)
    data = Batches(source, cfg.torch_dtype)
    eng = TorchNativeEngine(device, cfg, data, store, shard_degree=spec["shard"], timeout_s=30.0)
    eng.rebuild(plan, 0)
    eng.start_fresh()
    r, s = eng.place.replica, eng.place.stage
    prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(r, s)]
    losses = [eng.run(prog).loss for _ in range(iterations)]
    full = {k: h.tensors() for k, h in eng.full_state().items()}
    eng.release()
    plain, plain_losses = plain_pipeline_fsdp_run(
        s * plan.dp + r, plan.dp * plan.pp, dist.PrefixStore("plain/", store), cfg, data, pp=plan.pp,
        layer_ranges=list(plan.layer_ranges), num_microbatches=plan.num_microbatches,
        iterations=iterations, schedule=spec["plain"])
    if r == 0:
        torch.save(full, out / f"stage{s}.pt")
        torch.save(plain, out / f"plain_stage{s}.pt")
    (out / f"{device}.json").write_text(json.dumps(
        {"pid": os.getpid(), "replica": r, "stage": s, "losses": losses, "plain_losses": plain_losses}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
