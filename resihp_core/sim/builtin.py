"""Built-in simulation policies, registered through ``resihp_register_sim_policies``.

Kept light: each factory imports :mod:`.policies` only when a policy is created, so
loading the built-ins costs nothing for processes that never simulate.
"""

from __future__ import annotations

from typing import Any

from resihp_core.hookspecs import hookimpl

#: name -> class name in :mod:`resihp_core.sim.policies` (the report's column order).
POLICY_CLASSES = {
    "resihp": "ResiHP",
    "none": "NoMitigation",
    "recycle": "ReCycle",
    "oobleck": "Oobleck",
    "greyhound": "Greyhound",
    "adaptra": "Adaptra",
    "enh-recycle": "EnhancedReCycle",
    "enh-oobleck": "EnhancedOobleck",
    "torchft": "TorchFT",
    "checkpoint-restart": "CheckpointRestart",
}


def _factory(cls_name: str) -> Any:
    def make(**options: Any) -> Any:
        from resihp_core.sim import policies

        return getattr(policies, cls_name)(**options)

    make.__name__ = f"make_{cls_name}"
    make.__doc__ = f"Create :class:`resihp_core.sim.policies.{cls_name}`."
    return make


@hookimpl(trylast=True)
def resihp_register_sim_policies(registry: Any) -> None:
    for name, cls_name in POLICY_CLASSES.items():
        registry.register(name, _factory(cls_name))
