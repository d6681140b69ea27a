"""Entry point ``deepspeed``: registers the DeepSpeed PipelineEngine adapter. (The
``resihp launch`` command, which runs DeepSpeed configs through :mod:`.launch`, is
registered by the shared :mod:`resihp_adapters.launch`.)

Registration is lazy: this module imports neither torch nor deepspeed; the adapter class
(:class:`resihp_adapters.deepspeed.adapter.DeepSpeedAdapter`, which declares
``capabilities = CAPABILITIES``) is imported only when the adapter is created, and the
error then names the extra to install.

Every capability below is proven by the conformance kit
(``tests/adapters/deepspeed/test_deepspeed_conformance.py``): layer repartition,
cross-replica migration (DP work migration, and a whole replica dropped after a kill),
checkpoint restore. DeepSpeed takes TP from its topology grid, one degree for the whole
job: no TP resize, no heterogeneous TP. The engine runs 1F1B programs.
"""

from __future__ import annotations

from resihp_core.adapter import AdapterRegistry, Capabilities
from resihp_core.hookspecs import hookimpl
from resihp_core.plan import ScheduleKind

NAME = "deepspeed"
TARGET = "resihp_adapters.deepspeed.adapter:DeepSpeedAdapter"
CAPABILITIES = Capabilities(
    tp_resize=False,
    heterogeneous_tp=False,
    layer_repartition=True,
    cross_replica_migration=True,
    schedules=frozenset({ScheduleKind.ONE_F_ONE_B}),
    checkpoint=True,
    sdc_fingerprint=True,  # ZeRO 0 without bf16: replicas compare their state (deepspeed/sdc.py, docs/sdc.md)
)


@hookimpl(trylast=True)
def resihp_register_adapters(registry: AdapterRegistry) -> None:
    """First-party default (``trylast``): a plugin may register its own ``deepspeed``."""
    registry.register(
        NAME,
        TARGET,
        CAPABILITIES,
        description="DeepSpeed PipelineEngine (uniform TP, 1F1B)",
        install_hint="pip install 'resihp[deepspeed]'",
    )
