"""The built-in adaptation stages as a plugin (listed in :data:`resihp_core.plugins.BUILTINS`).

Registered ``trylast``: a plugin that registers ``tp``, ``pp`` or ``dp`` replaces the
built-in (keeping its order unless it gives one), and a plugin may add stages in
between (e.g. ``order=250`` runs between PP and DP).
"""

from __future__ import annotations

from resihp_core.hookspecs import hookimpl
from resihp_core.plugins import BUILTIN_STAGE_ORDER, StageRegistry
from resihp_core.scheduler.dp import dp_stage
from resihp_core.scheduler.pp import pp_stage
from resihp_core.scheduler.tp import drop_stage, tp_stage


@hookimpl(trylast=True)
def resihp_register_adaptation_stages(registry: StageRegistry) -> None:
    """The stages of :data:`~resihp_core.plugins.BUILTIN_STAGE_ORDER`, in its order."""
    stages = {"tp": tp_stage, "pp": pp_stage, "dp": dp_stage, "drop": drop_stage}
    for name in BUILTIN_STAGE_ORDER:
        registry.register(name, stages[name])
