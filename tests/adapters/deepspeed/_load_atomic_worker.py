"""One DeepSpeed pipeline process (a world of 1): ``load_all_or_nothing`` from a missing,
a corrupt (one layer file truncated), an other-model and another step's checkpoint
leaves every parameter, optimizer moment and the LR scheduler as they were; from a good
one it loads. Writes its findings to ``--out``/result.json."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from torch import nn


def _engine(hidden: int):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(nn.Linear, hidden, hidden) for _ in range(3)]
    torch.manual_seed(3)
    module = PipelineModule(layers, num_stages=1, loss_fn=lambda o, y: ((o - y) ** 2).mean())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 10}}}
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    return engine


def _state(engine) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    for i, p in enumerate(engine.module.parameters()):
        for k, v in engine.optimizer.state.get(p, {}).items():
            out[f"o.{i}.{k}"] = torch.as_tensor(v).detach().clone()
    out["lr"] = torch.tensor(engine.get_lr()[0])
    out["steps"] = torch.tensor(engine.global_steps)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import deepspeed

    from resihp_adapters.deepspeed.ds_checkpoint import CheckpointNotLoaded, load_all_or_nothing

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    data = iter([(torch.randn(2, 8, generator=torch.Generator().manual_seed(i)), torch.zeros(2, 8))
                 for i in range(100)])
    engine = _engine(8)
    for _ in range(2):
        engine.train_batch(data)
    good = os.path.join(a.out, "good")
    engine.save_checkpoint(good)  # step 2
    saved = _state(engine)
    engine.train_batch(data)
    step1 = os.path.join(a.out, "step3")
    engine.save_checkpoint(step1)  # step 3
    # Back at step 2 with other weights than the checkpoint's: a partial load would show.
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)
    engine.global_steps = 2
    before = _state(engine)
    tag = open(os.path.join(good, "latest")).read().strip()
    corrupt = os.path.join(a.out, "corrupt")
    shutil.copytree(good, corrupt)
    layer2 = os.path.join(corrupt, tag, "layer_02-model_states.pt")
    with open(layer2, "r+b") as f:
        f.truncate(os.path.getsize(layer2) // 2)
    other = os.path.join(a.out, "other")
    # Another model (hidden 16) saved under the same step: its layers do not fit.
    e2 = _engine(16)
    e2.global_steps = 2
    e2.save_checkpoint(other)
    results: dict[str, object] = {}
    for name, path, t in (("missing", os.path.join(a.out, "nowhere"), None),
                          ("missing_tag", good, "global_step99"), ("corrupt", corrupt, None),
                          ("other_model", other, None), ("other_step", step1, None)):
        try:
            got = load_all_or_nothing(engine, path, t, 2)
            outcome = f"returned {got[0]!r}"
        except CheckpointNotLoaded as e:
            outcome = f"refused: {e}"
        results[name] = {"outcome": outcome, "unchanged": _same(_state(engine), before)}
    path, _ = load_all_or_nothing(engine, good, None, 2)
    results["good"] = {"outcome": f"returned {path!r}", "loaded": _same(_state(engine), saved)}
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
