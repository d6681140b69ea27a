"""Megatron-Core adapter: a ``pretrain_gpt``-shaped job (GPTModel, Megatron's optimizer,
DDP, parameter scheduler and 1F1B schedule) kept running across plan generations
(``docs/megatron_core.md``)."""

from resihp_adapters.megatron_core.api import initialize

__all__ = ["initialize"]
