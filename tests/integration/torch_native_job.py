"""A scripted torch_native worker for tests: plan generations from a list, a real kill.

Run as ``python torch_native_job.py SPEC.json DEVICE STORE_PORT``. The spec names the
model, data, the plan of each generation and how many iterations it runs, an optional
kill (device, iteration, compute chunks into that iteration) and a checkpoint cadence.
Generation ``g + 1`` starts when generation ``g`` has run its iterations (a planned
change: repartition) or when a peer died (the survivors roll back the uncommitted
iteration, join the next generation's world in the same processes, and take state from
the survivors, or from the last DCP checkpoint when a shard has no surviving copy).
Each worker writes ``DEVICE.json`` (pid, losses, generations, how state moved) and the
lowest replica of each stage writes its stage's full tensors.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from resihp_core.plan import parse_plan
from resihp_core.predictor.schedules import emit_programs
from resihp_adapters.torch_native.data import DataSpec
from resihp_adapters.torch_native.engine import TorchNativeEngine
from resihp_adapters.torch_native.model import LlamaConfig
from resihp_adapters.torch_native.reference import plain_pipeline_fsdp_run
from resihp_adapters.torch_native.reshard import StateLost


def main(spec_path: str, device: int, port: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    cfg = LlamaConfig(**spec["model"])
    eng = TorchNativeEngine(device, cfg, DataSpec(**spec["data"]), store,
                            shard_degree=spec["shard"], lr=spec.get("lr", 1e-3),
                            timeout_s=spec.get("timeout_s", 5.0))
    plans = [parse_plan(p["plan"]) for p in spec["phases"]]
    ends = [p["until"] for p in spec["phases"]]
    kill = spec.get("kill")
    ckpt = spec.get("checkpoint_every", 0)
    report: dict = {"pid": os.getpid(), "device": device, "losses": {}, "generations": []}
    saved: list[int] = []

    chunks = [0]

    def before_action() -> None:
        chunks[0] += 1
        if kill and device == kill["device"] and eng.iteration == kill["iteration"] \
                and chunks[0] >= kill["chunk"]:
            os._exit(9)  # a real, unannounced death mid-iteration

    eng.before_action = before_action
    g, old = 0, None
    while True:
        plan = plans[g]
        t0 = time.perf_counter()
        eng.rebuild(plan, g)
        how = "fresh"
        if old is None:
            eng.start_fresh()
        else:
            alive = set(plan.devices())
            try:
                nbytes = eng.move_state(old, plan, alive, eng.iteration)
                how = f"moved {nbytes} bytes"
            except StateLost as e:
                step = max(s for s in saved if s <= eng.iteration)
                eng.load_checkpoint(str(out / f"ckpt{step}"), step)
                how = f"restored step {step}: {e}"
        report["generations"].append({"generation": g, "how": how, "iteration": eng.iteration,
                                      "rebuild_s": time.perf_counter() - t0})
        if eng.place is None:
            break  # no work for this device in this plan
        prog = next(p for p in emit_programs(plan)
                    if (p.replica, p.stage) == (eng.place.replica, eng.place.stage))
        failed = False
        try:
            while eng.iteration < ends[g]:
                it = eng.iteration
                eng.snapshot()
                chunks[0] = 0
                res = eng.run(prog, it)
                if eng.place.stage == plan.pp - 1:
                    report["losses"][f"{it}/{g}/{eng.place.replica}"] = res.loss
                # commit: nobody starts the next iteration before all finished this one
                store.set(f"gen{g}/done{it}/{device}", "1")
                store.wait([f"gen{g}/done{it}/{d}" for d in plan.devices()],
                           datetime.timedelta(seconds=60))
                if ckpt and eng.iteration % ckpt == 0:
                    eng.save_checkpoint(str(out / f"ckpt{eng.iteration}"))
                    saved.append(eng.iteration)
        except Exception as e:  # a peer died: handled below, outside the except block
            report["generations"][-1]["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            failed = True
        if failed:
            eng.rollback()
        elif g + 1 == len(plans):
            break
        old, g = plan, g + 1
    if eng.place is not None:
        full = eng.full_state()
        if eng.place.replica == 0:
            torch.save(full, out / f"stage{eng.place.stage}.pt")
        report["place"] = [eng.place.replica, eng.place.stage]
    report["iteration"] = eng.iteration
    eng.release()
    if spec.get("plain"):  # the same job in stock torch, in the same processes
        plan = plans[0]
        loc = plan.location(device)
        s, r = loc[1], loc[0]
        full, losses = plain_pipeline_fsdp_run(
            s * plan.dp + r, plan.dp * plan.pp, dist.PrefixStore("plain/", store), cfg,
            eng.data, pp=plan.pp, layer_ranges=list(plan.layer_ranges),
            num_microbatches=plan.num_microbatches, iterations=ends[0],
            lr=spec.get("lr", 1e-3), schedule=spec["plain"])
        if r == 0:
            torch.save(full, out / f"plain_stage{s}.pt")
        report["plain_losses"] = losses
    (out / f"{device}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
