"""Training state of one worker: parameter shards, AdamW state, snapshots, re-sharding
plans and checkpoints.

State is organised by *component* — ``embed`` (stage 0), ``layers.<i>`` and ``head``
(final norm + LM head, last stage) — because components are what moves when layers are
repartitioned or TP degrees change. Every tensor of a component (parameter, AdamW
``exp_avg`` and ``exp_avg_sq``) is sharded the same way, so moving "parameters and
optimizer state" is one mechanism (:func:`transfer_plan`), for any old/new TP degree.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import Tensor

from resihp_core.plan import ParallelPlan
from resihp_adapters.megatron_ref.model import ModelConfig, _full_shape, shard_dim
from resihp_adapters.torchkit.checkpoint import (  # noqa: F401 - re-exported for the adapter
    CheckpointError,
    latest_complete_checkpoint,
    load_component,
    save_component,
)
from resihp_adapters.torchkit.transfer import Transfer
from resihp_adapters.torchkit.transfer import transfer_plan as _transfer_plan

__all__ = [
    "AdamW",
    "component_of",
    "components_of_stage",
    "Transfer",
    "transfer_plan",
    "shard_range",
    "CheckpointError",
    "save_component",
    "load_component",
    "latest_complete_checkpoint",
]


# ------------------------------------------------------------------ components
def component_of(name: str) -> str:
    """``layers.3.wq.weight`` -> ``layers.3``; ``embed.weight`` -> ``embed``;
    ``final_norm.weight`` / ``lm_head.weight`` -> ``head``."""
    if name.startswith("layers."):
        return ".".join(name.split(".")[:2])
    if name.startswith("embed."):
        return "embed"
    if name.startswith(("final_norm.", "lm_head.")):
        return "head"
    raise KeyError(f"parameter {name!r} belongs to no component")


def components_of_stage(plan: ParallelPlan, stage: int) -> list[str]:
    a, b = plan.layer_ranges[stage]
    out = ["embed"] if stage == 0 else []
    out += [f"layers.{i}" for i in range(a, b)]
    if stage == plan.pp - 1:
        out.append("head")
    return out


def param_names(config: ModelConfig, component: str) -> list[str]:
    """Global parameter names of a component, sorted (the wire order of transfers)."""
    if component == "embed":
        return ["embed.weight"]
    if component == "head":
        return ["final_norm.weight", "lm_head.weight"]
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    return sorted(f"{component}.{n}.weight" for n in names)


def shard_range(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of TP rank ``tp_rank``'s shard of a dimension of ``size``."""
    if size % tp_size:
        raise ValueError(f"dimension {size} does not split {tp_size} ways")
    step = size // tp_size
    return tp_rank * step, (tp_rank + 1) * step


# ------------------------------------------------------------------ optimizer
class AdamW:
    """AdamW over named parameter shards, with state kept per name so that shards can be
    moved and re-sharded with their parameters. Decoupled weight decay, bias correction
    with the global step (= iterations completed), as in torch.optim.AdamW."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.state: dict[str, tuple[Tensor, Tensor]] = {}

    def ensure(self, name: str, p: Tensor) -> tuple[Tensor, Tensor]:
        if name not in self.state:
            self.state[name] = (torch.zeros_like(p), torch.zeros_like(p))
        return self.state[name]

    @torch.no_grad()
    def step(self, params: Mapping[str, Tensor], step: int) -> None:
        """Apply update number ``step`` (1-based) to every parameter with a gradient."""
        b1, b2 = self.betas
        c1, c2 = 1 - b1**step, 1 - b2**step
        for name, p in params.items():
            if p.grad is None:
                continue
            m, v = self.ensure(name, p)
            g = p.grad
            p.mul_(1 - self.lr * self.weight_decay)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / c2).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / c1)


# ------------------------------------------------------------------ re-sharding plan
def transfer_plan(old: ParallelPlan, new: ParallelPlan, alive: Iterable[int]) -> list[Transfer]:
    """Every shard movement from ``old`` (on ``alive``) to ``new``, by this model's components."""
    return _transfer_plan(old, new, alive, components_of_stage)


def piece_slices(config: ModelConfig, name: str, tr: Transfer) -> tuple[slice, slice, int] | None:
    """For parameter ``name`` of a transfer: (slice of the source shard, slice of the
    destination shard, dim), or None when this source sends nothing for it (a replicated
    parameter comes only from the source shard covering the destination's start)."""
    d = shard_dim(name)
    if d is None:
        # Replicated: the one source member whose range holds the destination's start.
        first = (tr.dst_tp * tr.src_deg) // tr.dst_deg
        return (slice(None), slice(None), 0) if tr.src_tp == first else None
    size = _full_shape(config, name)[d]
    a0, a1 = shard_range(size, tr.src_tp, tr.src_deg)
    b0, b1 = shard_range(size, tr.dst_tp, tr.dst_deg)
    lo, hi = max(a0, b0), min(a1, b1)
    if lo >= hi:
        return None
    return slice(lo - a0, hi - a0), slice(lo - b0, hi - b0), d


def shard_shape(config: ModelConfig, name: str, tp_rank: int, tp_size: int) -> tuple[int, ...]:
    shape = list(_full_shape(config, name))
    d = shard_dim(name)
    if d is not None:
        a, b = shard_range(shape[d], tp_rank, tp_size)
        shape[d] = b - a
    return tuple(shape)


def _index(dim: int, sl: slice) -> tuple:
    return (slice(None),) * dim + (sl,)


def pack(config: ModelConfig, tr: Transfer, tensors: Mapping[str, tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    """Flatten the source side's pieces (param, exp_avg, exp_avg_sq per parameter)."""
    parts = []
    for name in param_names(config, tr.component):
        sl = piece_slices(config, name, tr)
        if sl is None:
            continue
        src, _, d = sl
        parts += [t[_index(d, src)].reshape(-1) for t in tensors[name]]
    return torch.cat(parts) if parts else torch.empty(0)


def unpack(config: ModelConfig, tr: Transfer, flat: Tensor,
           into: Mapping[str, tuple[Tensor, Tensor, Tensor]]) -> None:
    """Write a received flat buffer into the destination shards ``into``."""
    pos = 0
    for name in param_names(config, tr.component):
        sl = piece_slices(config, name, tr)
        if sl is None:
            continue
        _, dst, d = sl
        for t in into[name]:
            view = t[_index(d, dst)]
            n = view.numel()
            view.copy_(flat[pos : pos + n].view_as(view))
            pos += n
    if pos != flat.numel():
        raise ValueError(f"transfer of {tr.component} from device {tr.src}: size mismatch")


def transfer_numel(config: ModelConfig, tr: Transfer) -> int:
    n = 0
    for name in param_names(config, tr.component):
        sl = piece_slices(config, name, tr)
        if sl is None:
            continue
        _, dst, d = sl
        shape = list(shard_shape(config, name, tr.dst_tp, tr.dst_deg))
        shape[d] = len(range(*dst.indices(shape[d])))
        n += 3 * int(torch.Size(shape).numel())
    return n


