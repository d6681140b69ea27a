"""A user's GPT-style DeepSpeed pipeline script (run by ``resihp launch``): the token
embedding and the LM head are one tied group (``TiedLayerSpec``), transformer blocks
from ``torch.nn`` with dropout, ``gradient_clipping`` in the JSON. Two variants cover
every value of each factor the complete-state test checks, and a third is the opt-in
FusedAdam job:

- ``json``: float64, the JSON's ``Adam`` optimizer and ``WarmupLR`` scheduler, stages
  split by ``partition_method="parameters"``;
- ``torch``: bf16, a torch ``AdamW`` factory and a user ``LambdaLR`` factory;
- ``fused``: ``json`` in float32, the JSON naming DeepSpeed's ``FusedAdam``
  (``torch_adam: false``; FusedAdam takes no float64).

Every variant reads its data through the user's own loader, DeepSpeed's
``RepeatingLoader(engine.deepspeed_io(dataset))`` given to ``train_batch``.

Each rank writes ``rank<R>.pt`` under ``--out``: per committed iteration its loss and
learning rate, and ``engine.full_state()`` after the last one.
"""

from __future__ import annotations

import argparse
import os

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.utils import RepeatingLoader
from torch import nn

from resihp_adapters.deepspeed import initialize

V, H, T = 64, 32, 8


class Embed(nn.Module):
    """Token embedding; as the LM head (``head``) the same weight gives the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, H) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


def head(module: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight.t()


class Block(nn.TransformerEncoderLayer):
    def __init__(self) -> None:
        # No biases: an attention key bias gets no gradient, and under bf16 Adam turns its
        # rounding noise into updates of full size, which no two runs share.
        super().__init__(H, nhead=2, dim_feedforward=2 * H, dropout=0.1, batch_first=True, bias=False)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        ids = torch.randint(V, (T + 1,), generator=torch.Generator().manual_seed(i))
        return ids[:-1], ids[1:]


def xent(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = logits.float() if logits.dtype == torch.bfloat16 else logits  # bf16: the loss in fp32
    return nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=["json", "torch", "fused"], required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64 if a.variant == "json" else torch.float32)
    layers = [TiedLayerSpec("embed", Embed), *[LayerSpec(Block) for _ in range(4)],
              TiedLayerSpec("embed", Embed, forward_fn=head)]
    kw = {}
    if a.variant == "torch":
        kw = dict(optimizer=lambda ps: torch.optim.AdamW(ps, lr=2e-3, weight_decay=0.01),
                  lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 15)))
    else:
        kw = dict(partition_method="parameters")
    data = Tokens()
    # Dropout: seeded per layer and micro-batch, so a recovery draws the same masks.
    engine = initialize(layers, loss_fn=xent, training_data=data, base_seed=11, seed_layers=True, **kw)
    batches = RepeatingLoader(engine.deepspeed_io(data))  # the user's own loader (a shuffling sampler)
    log, full = [], {}
    while True:
        loss = engine.train_batch(batches)
        if loss is None:
            break
        log.append({"iteration": engine.iteration, "loss": float(loss) if engine.is_last_stage() else None,
                    "returned": float(loss), "lr": engine.get_lr(), "pid": os.getpid()})
        full = engine.full_state()
        print(f"rank={engine.global_rank} iteration={engine.iteration} lr={engine.get_lr()} loss={loss}", flush=True)
    torch.save({"log": log, "full": full}, os.path.join(a.out, f"rank{engine.global_rank}.pt"))


if __name__ == "__main__":
    main()
