"""Entry point ``megatron_ref``: registers the reference Megatron-style backend.

Registration is lazy: this module imports neither torch nor the adapter module; the
adapter class is imported only when the adapter is created. The adapter class should
declare ``capabilities = CAPABILITIES`` from here, so the two never drift apart.
"""

from __future__ import annotations

from resihp_core.adapter import AdapterRegistry, Capabilities
from resihp_core.hookspecs import hookimpl
from resihp_core.plan import ScheduleKind

NAME = "megatron_ref"
TARGET = "resihp_adapters.megatron_ref.adapter:MegatronRefAdapter"
CAPABILITIES = Capabilities(
    tp_resize=True,
    heterogeneous_tp=True,
    layer_repartition=True,
    cross_replica_migration=True,
    schedules=frozenset({ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1}),
    checkpoint=True,
    sdc_fingerprint=True,
    memory_copy=True,
)


@hookimpl(trylast=True)
def resihp_register_adapters(registry: AdapterRegistry) -> None:
    """First-party default (``trylast``): a plugin may register its own ``megatron_ref``."""
    registry.register(
        NAME,
        TARGET,
        CAPABILITIES,
        description="reference TP x PP x DP backend in pure torch (heterogeneous TP)",
        install_hint="pip install torch",
        job_config="resihp_adapters.megatron_ref.plugin:job_section",
        reference="resihp_adapters.megatron_ref.reference:reference_losses",
        default=True,
    )


def job_section(cfg) -> dict:
    """This adapter's job section: the model of ``[model]``, dtype and learning rate of
    ``[training]``, plus any field of ``[adapter]`` (which wins)."""
    mod, tr = cfg.model, cfg.training
    section = dict(vocab_size=mod.vocab, hidden=mod.hidden, num_heads=mod.heads, ffn_hidden=mod.ffn,
                   num_layers=mod.layers, dtype=tr.dtype, seed=tr.seed, lr=tr.lr, backend=cfg.runtime.backend,
                   devices_per_node=cfg.runtime.devices_per_node)
    known = set(section)
    unknown = sorted(set(cfg.adapter) - known)
    if unknown:
        raise ValueError(f"adapter: unknown field(s) {unknown} for megatron_ref (known: {sorted(known)})")
    return {**section, **cfg.adapter}
