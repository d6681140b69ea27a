"""Entry point ``megatron_core``: registers the Megatron-Core adapter.

Registration is lazy: this module imports neither torch nor megatron; the adapter class
(:class:`resihp_adapters.megatron_core.adapter.MegatronCoreAdapter`, which declares
``capabilities = CAPABILITIES``) is imported only when a worker creates it.

What is declared is what the conformance kit runs
(``tests/conformance/test_megatron_core.py``): TP resize (one degree for the whole job;
a departing TP member sends its shards in a world of every device before Megatron's
world is built), layer repartition (``pipeline_model_parallel_layout``), whole
micro-batches moved between replicas (each replica runs Megatron's own 1F1B over its own
micro-batch count; a replica with no devices drops out) and checkpoint restore. Not
declared: heterogeneous TP (one TP size per world in Megatron-Core's parallel state),
single pipeline stages run by another replica, other schedules than 1F1B.
"""

from __future__ import annotations

from resihp_core.adapter import AdapterRegistry, Capabilities
from resihp_core.hookspecs import hookimpl
from resihp_core.plan import ScheduleKind

NAME = "megatron_core"
TARGET = "resihp_adapters.megatron_core.adapter:MegatronCoreAdapter"
CAPABILITIES = Capabilities(
    tp_resize=True,
    heterogeneous_tp=False,
    layer_repartition=True,
    cross_replica_migration=False,
    uneven_dp=True,
    schedules=frozenset({ScheduleKind.ONE_F_ONE_B}),
    checkpoint=True,
    tp_with_dp=True,
)


@hookimpl(trylast=True)
def resihp_register_adapters(registry: AdapterRegistry) -> None:
    """First-party default (``trylast``): a plugin may register its own ``megatron_core``."""
    registry.register(
        NAME,
        TARGET,
        CAPABILITIES,
        description="Megatron-Core GPTModel, optimizer, DDP and 1F1B (fixed TP)",
        install_hint="pip install 'resihp[megatron-core]'",
        job_config="resihp_adapters.megatron_core.plugin:job_section",
    )


def job_section(cfg) -> dict:
    """This adapter's job section: with ``[adapter] user = "module:function"`` the user's
    job (its model, optimizer and data are its own; ``[model] layers`` must match);
    otherwise the built-in GPT job sized by ``[model]`` and ``[training] lr``. Any field
    of ``[adapter]`` wins."""
    runtime = dict(backend=cfg.runtime.backend, devices_per_node=cfg.runtime.devices_per_node)
    if cfg.adapter.get("user"):
        return {**runtime, **cfg.adapter}
    mod = cfg.model
    section = dict(vocab_size=mod.vocab, hidden=mod.hidden, num_heads=mod.heads, ffn_hidden=mod.ffn,
                   num_layers=mod.layers, lr=cfg.training.lr, **runtime)
    return {**section, **cfg.adapter}
