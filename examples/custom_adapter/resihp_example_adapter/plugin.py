"""The entry-point module: registers the ``example`` adapter.

Keep this module light. It is imported every time ResiHP starts, so it names the
adapter class by import path instead of importing it (a real adapter module would pull
in its framework).
"""

from __future__ import annotations

from resihp_core.adapter import AdapterRegistry, Capabilities
from resihp_core.hookspecs import hookimpl
from resihp_core.plan import ScheduleKind

CAPABILITIES = Capabilities(
    tp_resize=False,
    heterogeneous_tp=False,
    layer_repartition=False,
    cross_replica_migration=True,  # runs any replica's micro-batches: replica drop, migration
    schedules=frozenset({ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B}),
    checkpoint=True,
)


@hookimpl
def resihp_register_adapters(registry: AdapterRegistry) -> None:
    registry.register(
        "example",
        "resihp_example_adapter.adapter:ExampleAdapter",
        CAPABILITIES,
        description="data-parallel linear model in torch (one stage, TP 1): an adapter to copy",
    )
