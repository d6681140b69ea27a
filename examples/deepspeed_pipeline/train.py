"""A DeepSpeed pipeline training script that runs under plain ``accelerate launch`` and,
unchanged, under ``resihp launch`` (which keeps it training through dead and slow
devices). The only ResiHP-specific line is the ``initialize`` import.

    accelerate launch --config_file accelerate.yaml train.py --iterations 6
    resihp launch     --config_file accelerate.yaml train.py --iterations 6

A checkpoint in DeepSpeed's own format moves a job between the two:

    resihp launch     ... train.py --iterations 6 --save-dir ckpt --save-at 2
    accelerate launch ... train.py --iterations 6 --load-dir ckpt   # trains steps 3-6
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
from deepspeed.pipe import LayerSpec
from deepspeed.utils import RepeatingLoader
from torch import nn

from resihp_adapters.deepspeed import initialize


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Wide(nn.Module):
    """The first layer: twice the parameters of a ``Block``, so DeepSpeed's
    ``partition_method="parameters"`` gives stage 0 fewer layers than "uniform" would."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(torch.tanh(self.up(x))))


class Pairs(torch.utils.data.Dataset):
    """A map-style dataset: sample i is always the same (x, y) pair."""

    def __init__(self, n: int, hidden: int) -> None:
        self.n, self.hidden = n, hidden

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.hidden, generator=g)
        return x, torch.sin(x).flip(0)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    ap.add_argument("--save-dir", help="engine.save_checkpoint here (DeepSpeed's format) after --save-at steps")
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--load-dir", help="engine.load_checkpoint from here first")
    a = ap.parse_args()
    deepspeed.init_distributed()  # as a plain DeepSpeed script does (deferred under resihp launch)
    torch.set_default_dtype(getattr(torch, a.dtype))
    torch.set_num_threads(1)
    torch.manual_seed(7)  # DeepSpeed builds the layers from this (seed_layers=False, its default)
    layers = [LayerSpec(Wide, a.hidden), *(LayerSpec(Block, a.hidden) for _ in range(a.layers - 1))]
    # As a plain DeepSpeed script: stages balanced by parameter count, and DeepSpeed's own
    # data loader (engine.deepspeed_io: a shuffling DistributedSampler per replica).
    dataset = Pairs(4096, a.hidden)
    engine = initialize(layers, loss_fn=mse, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                        training_data=dataset, partition_method="parameters")
    # DeepSpeed's engine API, before the first step, under either launcher.
    print(f"rank={os.environ.get('RANK')} start stage_id={engine.stage_id} "
          f"local_layers={len(engine.module.forward_funcs)} optimizer={type(engine.optimizer).__name__} "
          f"lr={engine.get_lr()[0]:g} global_steps={engine.global_steps}", flush=True)
    train_iter = RepeatingLoader(engine.deepspeed_io(dataset))
    if a.load_dir:
        engine.load_checkpoint(a.load_dir)
        for _ in range(engine.global_steps * engine.gradient_accumulation_steps()):
            next(train_iter)  # the data resumes where the checkpoint's step left it
    while engine.iteration < a.iterations:
        loss = engine.train_batch(train_iter)
        if loss is None:  # the job ended (resihp launch decides how many iterations)
            break
        shown = f" loss={loss:.10f}" if engine.is_last_stage() else ""
        print(f"rank={os.environ.get('RANK')} pid={os.getpid()} iteration={engine.iteration}{shown}", flush=True)
        if a.save_dir and engine.iteration == a.save_at:
            engine.save_checkpoint(a.save_dir)


if __name__ == "__main__":
    main()
