"""A small pipeline job for demos, benchmarks and the conformance kit: tanh-MLP blocks
as ``LayerSpec``s, a deterministic map-style dataset, MSE loss, AdamW.

Named from a job's ``adapter_config`` as ``{"model": "resihp_adapters.deepspeed.toy:build",
"hidden": 64, "num_layers": 6, "micro_batch_size": 2, "lr": 1e-3, "dtype": "float64"}``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from resihp_adapters.deepspeed.spec import PipelineSpec

__all__ = ["Block", "Samples", "mse", "build"]


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Samples(torch.utils.data.Dataset):
    """Sample ``i`` is always the same ``(x, sin(x) reversed)`` pair."""

    def __init__(self, n: int, hidden: int) -> None:
        self.n, self.hidden = n, hidden

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(self.hidden, generator=g, dtype=torch.get_default_dtype())
        return x, torch.sin(x).flip(0)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def build(adapter_config: dict[str, Any], job: Any) -> PipelineSpec:
    from deepspeed.pipe import LayerSpec

    dtype = str(adapter_config.get("dtype", "float64"))
    if dtype not in ("float32", "float64"):
        raise ValueError(f"adapter_config.dtype must be float32 or float64, got {dtype!r}")
    torch.set_default_dtype(getattr(torch, dtype))
    hidden, layers = int(adapter_config.get("hidden", 64)), int(adapter_config.get("num_layers", 6))
    mbs, lr = int(adapter_config.get("micro_batch_size", 2)), float(adapter_config.get("lr", 1e-3))
    config = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": job.num_microbatches,
              "train_batch_size": mbs * job.num_microbatches * job.dp, "zero_optimization": {"stage": int(adapter_config.get("zero_stage", 0))},
              "steps_per_print": 10**9}
    return PipelineSpec(layers=[LayerSpec(Block, hidden) for _ in range(layers)], config=config,
                        dataset=Samples(4096, hidden), loss_fn=mse,
                        optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr), base_seed=int(adapter_config.get("seed", 7)))
