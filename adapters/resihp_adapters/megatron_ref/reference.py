"""Single-process reference training: the whole model, every micro-batch of every
replica, the same data, loss normalisation and AdamW as the distributed backend.
Training semantics are proven by comparing a distributed run against this."""

from __future__ import annotations

import torch
from torch import Tensor

from resihp_adapters.megatron_ref.data import DataSpec, label_count, micro_batch
from resihp_adapters.megatron_ref.model import ModelConfig, build_model
from resihp_adapters.megatron_ref.state import AdamW

__all__ = ["reference_run", "reference_losses", "reference_trajectory"]


def reference_run(model: ModelConfig, data: DataSpec, iterations: int, lr: float = 1e-3,
                  ) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor]], list[float]]:
    """Train ``iterations`` iterations; returns full (param, exp_avg, exp_avg_sq) by
    global name and the per-iteration mean loss."""
    state: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    losses = []
    for _, loss, state in reference_trajectory(model, data, iterations, lr):
        losses.append(loss)
    return state, losses


def reference_trajectory(model: ModelConfig, data: DataSpec, iterations: int, lr: float = 1e-3, *,
                         start: int = 0, state: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None,
                         reverse: bool = False):
    """Yield ``(iteration, loss, state)`` after each iteration up to ``iterations``,
    ``state`` the full (param, exp_avg, exp_avg_sq) by global name (copies): what a
    checkpoint of that iteration must hold. With ``state`` (a checkpoint of iteration
    ``start - 1``) it continues from there instead of the seeded initial weights.
    ``reverse`` adds the micro-batches' gradients in the opposite order: the same
    training up to rounding, as a plan that moved work computes it (for studying how
    rounding differences grow, ``benchmarks/soak_sensitivity.py``)."""
    torch.manual_seed(0)
    net = build_model(model)
    opt = AdamW(lr=lr)
    if state is not None:
        with torch.no_grad():
            for name, p in net.named_parameters():
                sp, sm, sv = state[name]
                p.copy_(sp)
                opt.state[name] = (sm.clone().to(p.dtype), sv.clone().to(p.dtype))
    for it in range(start, iterations):
        denom = float(label_count(data, it))
        total = 0.0
        order = [(owner, mb) for owner in range(data.dp) for mb in range(data.num_microbatches)]
        for owner, mb in reversed(order) if reverse else order:
            b = micro_batch(data, it, owner, mb)
            loss = net(b.tokens, b.lengths, b.labels) / denom
            loss.backward()
            total += float(loss.detach())
        params = dict(net.named_parameters())
        opt.step(params, it + 1)
        for p in params.values():
            p.grad = None
        out = {}
        for name, p in net.named_parameters():
            m, v = opt.ensure(name, p)
            out[name] = (p.detach().clone(), m.clone(), v.clone())
        yield it, total, out


def reference_losses(job, iterations: int) -> list[float]:
    """Fault-free losses of ``job`` (a :class:`~resihp_core.job.JobSpec`) in one process."""
    from resihp_adapters.megatron_ref.adapter import data_spec, model_config

    torch.set_num_threads(1)  # on a shared, loaded machine more threads thrash (25 s vs 4 s)
    return reference_run(model_config(job), data_spec(job), iterations,
                         lr=float(job.adapter_config.get("lr", 1e-3)))[1]
