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
    )
