"""One process of the TP fidelity check: the tiny HF LLaMA of ``examples/hf_llama``
(GQA, tied embeddings, AdamW, warm-up + cosine, clipping at 1.0) trained by the
torch_native engine under TP2 x PP2 x DP1 (its own ``TPStage`` peers, lowered core
programs), then by stock torch (``parallelize_module`` + ``PipelineStage`` +
``Schedule1F1B``) in a fresh world. Run as ``python torch_native_tp_job.py SPEC.json
DEVICE STORE_PORT``; writes ``tp-DEVICE.pt`` (losses on TP index 0 of the last stage,
the flattened complete stage state on TP index 0 of each stage)."""

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
from resihp_adapters.torch_native.reference import StockPipeline  # noqa: E402
from resihp_adapters.torch_native.tp import TPEngine  # noqa: E402


def job(spec: dict):  # noqa: ANN201 - UserJob
    return user_job(tiny_model("llama"), optimizer=adamw, lr_scheduler=warmup_cosine(spec["iterations"]),
                    max_grad_norm=1.0, dataset=TextWindows(spec["text"], 16), micro_batch_size=2)


def main(spec_path: str, device: int, port: int) -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    plan, iterations = parse_plan(spec["plan"]), spec["iterations"]
    user = job(spec)
    eng = TPEngine(device, user.stages, user.data(plan.dp * plan.num_microbatches), dist.PrefixStore("tp/", store),
                   recipe=user.recipe, timeout_s=60.0)
    eng.rebuild(plan, 0)
    eng.start_fresh()
    pl = eng.place
    prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(pl.replica, pl.stage)]
    losses = [eng.run(prog).loss for _ in range(iterations)]
    state = eng.flat_state()
    eng.release()
    dist.init_process_group("gloo", store=dist.PrefixStore("stock/", store), rank=device, world_size=plan.pp * 2,
                            timeout=datetime.timedelta(seconds=60))
    user = job(spec)  # a fresh copy of the user's objects, as a plain launch would have
    stock = StockPipeline(user.stages, user.data(plan.dp * plan.num_microbatches), pp=plan.pp,
                          num_microbatches=plan.num_microbatches, layer_ranges=list(plan.layer_ranges),
                          recipe=user.recipe, tp=2)
    stock_losses = [stock.step() for _ in range(iterations)]
    stock_state = stock.flat_state()
    dist.destroy_process_group()
    first = pl.tp_index == 0
    torch.save({"stage": pl.stage, "tp_index": pl.tp_index, "losses": losses if first else [],
                "stock_losses": stock_losses if first else [], "state": state if first else {},
                "stock_state": stock_state if first else {}, "tp_state_equal": state.keys() == stock_state.keys()},
               Path(spec["out"]) / f"tp-{device}.pt")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
