"""One process of the Hugging Face fidelity test: a tiny HF model trained with the
user's AdamW, LambdaLR warm-up and clipping at 1.0 by the torch_native engine (core
programs lowered into torch's pipeline runtime, FSDP2 / HSDP), then the same under stock
``Schedule1F1B`` + ``fully_shard``, for each case of the spec (a JSON list). Half-way the engine loses device 1 and the
other three continue as pp3 x dp1, their state restored from a DCP checkpoint or moved
from memory (``spec["recover"]``). Run as ``python torch_native_hf_job.py SPEC.json
DEVICE STORE_PORT``; writes ``KIND-DEVICE.pt`` (both runs' flattened complete stage state on
the lowest replica of each stage, losses everywhere). A case with ``"tp": true`` is the
tensor-parallel one instead (:func:`run_tp_case`, ``KIND-tp-DEVICE.pt``)."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "hf_llama"))

from hf_model import TextWindows, adamw, tiny_model, warmup_cosine  # noqa: E402

from resihp_core.plan import parse_plan  # noqa: E402
from resihp_core.predictor.schedules import emit_programs  # noqa: E402
from resihp_adapters.torch_native.api import user_job  # noqa: E402
from resihp_adapters.torch_native.engine import TorchNativeEngine  # noqa: E402
from resihp_adapters.torch_native.reference import StockPipeline  # noqa: E402
from resihp_adapters.torch_native.tp import TPEngine  # noqa: E402


def job(spec: dict):
    return user_job(tiny_model(spec["kind"]), optimizer=adamw, lr_scheduler=warmup_cosine(spec["iterations"]),
                    max_grad_norm=1.0, dataset=TextWindows(spec["text"], 16), micro_batch_size=2)


def main(spec_path: str, device: int, port: int) -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(spec_path).read_text())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    for c, spec in enumerate(cases):  # one process set for every case: startup is most of the cost
        run_case(spec, device, dist.PrefixStore(f"case{c}/", store))


def run_tp_case(spec: dict, device: int, store: dist.Store) -> None:
    """TP2 x PP2 x DP1 (``spec["plan"]``): the engine (DTensor TP from the model's own HF
    plan, TPStage peers, lowered core programs), then stock torch in a fresh world
    (``parallelize_module`` + ``PipelineStage`` + ``Schedule1F1B``). Losses and states
    are kept on TP index 0 (its TP peers hold the same)."""
    plan, iterations = parse_plan(spec["plan"]), spec["iterations"]
    user = job(spec)
    eng = TPEngine(device, user.stages, user.data(plan.dp * plan.num_microbatches), store, recipe=user.recipe,
                   timeout_s=60.0)
    eng.rebuild(plan, 0)
    eng.start_fresh()
    pl = eng.place
    prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(pl.replica, pl.stage)]
    losses = [eng.run(prog).loss for _ in range(iterations)]
    state = eng.flat_state()
    eng.release()
    tp = plan.degree(0, 0)
    dist.init_process_group("gloo", store=dist.PrefixStore("plain/", store), rank=pl.stage * tp + pl.tp_index,
                            world_size=plan.pp * tp, timeout=datetime.timedelta(seconds=60))
    user = job(spec)  # a fresh copy of the user's objects, as a plain launch would have
    stock = StockPipeline(user.stages, user.data(plan.dp * plan.num_microbatches), pp=plan.pp,
                          num_microbatches=plan.num_microbatches, layer_ranges=list(plan.layer_ranges),
                          recipe=user.recipe, tp=tp)
    stock_losses = [stock.step() for _ in range(iterations)]
    stock_state = stock.flat_state()
    dist.destroy_process_group()
    first = pl.tp_index == 0
    torch.save({"replica": 0, "stage": pl.stage, "losses": losses if first else [],
                "stock_losses": stock_losses if first else [], "state": state if first else {},
                "stock_state": stock_state if first else {}},
               Path(spec["out"]) / f"{spec['kind']}-tp-{device}.pt")


def run_case(spec: dict, device: int, store: dist.Store) -> None:
    if spec.get("tp"):
        return run_tp_case(spec, device, store)
    plan, iterations = parse_plan(spec["plan"]), spec["iterations"]
    user = job(spec)
    data = user.data(plan.dp * plan.num_microbatches)
    eng = TorchNativeEngine(device, user.stages, data, store, shard_degree=spec["shard"], recipe=user.recipe,
                            timeout_s=60.0)
    eng.rebuild(plan, 0)
    eng.start_fresh()
    r, s = eng.place.replica, eng.place.stage
    prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(r, s)]
    half = iterations // 2
    losses = [eng.run(prog).loss for _ in range(half)]
    # Device 1 is lost after `half` iterations: the other three go on as pp3 x dp1 (new
    # stage boundaries, the tied head on another stage), with their state read back from
    # a DCP checkpoint ("restore") or moved from the survivors' memory (HSDP, "move").
    ckpt = str(Path(spec["out"]) / "ckpt")
    if spec["recover"] == "restore":
        eng.save_checkpoint(ckpt)
    state: dict = {}
    if device != 1:
        new = parse_plan(spec["plan_after"])
        eng.rebuild(new, 1, [0, 2, 3])
        if spec["recover"] == "restore":
            eng.load_checkpoint(ckpt, half)
        else:
            eng.move_state(plan, new, {0, 2, 3}, half)
        prog = {(p.replica, p.stage): p for p in emit_programs(new)}[(eng.place.replica, eng.place.stage)]
        losses += [eng.run(prog).loss for _ in range(iterations - half)]
        state = eng.flat_state()
    eng.release()
    rank = s * plan.dp + r
    dist.init_process_group("gloo", store=dist.PrefixStore("plain/", store), rank=rank,
                            world_size=plan.dp * plan.pp, timeout=datetime.timedelta(seconds=60))
    user = job(spec)  # a fresh copy of the user's objects, as a plain launch would have
    stock = StockPipeline(user.stages, user.data(plan.dp * plan.num_microbatches), pp=plan.pp,
                          num_microbatches=plan.num_microbatches, layer_ranges=list(plan.layer_ranges),
                          shard=spec["shard"], recipe=user.recipe)
    stock_losses = [stock.step() for _ in range(iterations)]
    stock_state = stock.flat_state()
    dist.destroy_process_group()
    torch.save({"replica": r, "stage": s, "losses": losses, "stock_losses": stock_losses,
                "state": state, "stock_state": stock_state if r == 0 else {}},
               Path(spec["out"]) / f"{spec['kind']}-{device}.pt")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
