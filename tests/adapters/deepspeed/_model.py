"""A tiny float64 pipeline model and dataset shared by the DeepSpeed adapter's tests."""

from __future__ import annotations

import torch
from torch import nn

H = 16


class Block(nn.Module):
    def __init__(self, h: int = H) -> None:
        super().__init__()
        self.fc = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Samples(torch.utils.data.Dataset):
    """Deterministic (x, y) pairs: sample i comes from its own seeded generator."""

    def __init__(self, n: int = 512, h: int = H) -> None:
        self.n, self.h = n, h

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(self.h, generator=g, dtype=torch.float64)
        return x, torch.sin(x).flip(0)


def layer_specs(num_layers: int = 6, h: int = H):
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(Block, h) for _ in range(num_layers)]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def config(micro_batch_size: int = 2, num_microbatches: int = 4, dp: int = 2, zero: int = 0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": num_microbatches,
        "train_batch_size": micro_batch_size * num_microbatches * dp,
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "resihp": {"timeout_s": 10},
    }


def build(adapter_config: dict, job):
    """The job builder the adapter's ``adapter_config.model`` names (conformance kit)."""
    from resihp_adapters.deepspeed.spec import PipelineSpec

    torch.set_default_dtype(torch.float64)
    lr = float(adapter_config.get("lr", 1e-3))
    cfg = config(adapter_config.get("micro_batch_size", 2), job.num_microbatches, job.dp,
                 adapter_config.get("zero", 0))
    h = int(adapter_config.get("hidden", H))
    return PipelineSpec(layers=layer_specs(int(adapter_config.get("num_layers", 6)), h), config=cfg, dataset=Samples(h=h),
                        loss_fn=mse, optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr),
                        base_seed=int(adapter_config.get("seed", 7)))
