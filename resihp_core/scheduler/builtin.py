"""The built-in adaptation stages as a plugin (listed in :data:`resihp_core.plugins.BUILTINS`).

Registered ``trylast``: a plugin that registers ``tp``, ``pp`` or ``dp`` replaces the
built-in (keeping its order unless it gives one), and a plugin may add stages in
between (e.g. ``order=250`` runs between PP and DP).
"""

from __future__ import annotations

from resihp_core.hookspecs import hookimpl
from resihp_core.plugins import StageRegistry
from resihp_core.scheduler.dp import dp_stage
from resihp_core.scheduler.pp import pp_stage
from resihp_core.scheduler.tp import drop_stage, tp_stage


@hookimpl(trylast=True)
def resihp_register_adaptation_stages(registry: StageRegistry) -> None:
    """TP selective exclusion (100), PP layer repartition (200), DP migration (300),
    then the TP-level escalation that drops still-slow groups when faster (400)."""
    registry.register("tp", tp_stage)
    registry.register("pp", pp_stage)
    registry.register("dp", dp_stage)
    registry.register("drop", drop_stage, order=400)
