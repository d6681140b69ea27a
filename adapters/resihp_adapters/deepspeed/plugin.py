"""Entry point ``deepspeed``: registers the DeepSpeed PipelineEngine adapter.

Registration is lazy: this module imports neither torch nor deepspeed; the adapter class
is imported only when the adapter is created, and the error then names the extra to
install. The adapter class should declare ``capabilities = CAPABILITIES`` from here.

DeepSpeed takes TP from its topology grid, one degree for the whole job, so no
heterogeneous TP; its engine runs a 1F1B schedule, which the adapter extends with its
own instructions for migrated work.
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
