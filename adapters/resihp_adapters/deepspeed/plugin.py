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

from dataclasses import replace
from typing import Any, Mapping

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

#: What a job with ZeRO stage 1 or bf16 can run: no partial replica (ZeRO 1 and
#: DeepSpeed's ``BF16_Optimizer`` reduce and partition over DeepSpeed's data-parallel
#: group with their own averaging, which a replica missing a stage would skew), whole
#: micro-batches on another whole replica, and a re-stage onto whole replicas of another
#: stage count (state moved, or restored, by global layer index), so that every survivor
#: stays busy (docs/deepspeed.md, partial replicas).
WHOLE_REPLICA_CAPABILITIES = replace(CAPABILITIES, cross_replica_migration=False, uneven_dp=True, restage=True)


def capabilities_for(ds_config: Mapping[str, Any]) -> Capabilities:
    """The capabilities of a job with DeepSpeed configuration ``ds_config``: ZeRO 0 in
    fp32/fp64 runs partial replicas as they are (:data:`CAPABILITIES`); ZeRO 1 or bf16
    runs whole replicas only (:data:`WHOLE_REPLICA_CAPABILITIES`)."""
    zero = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    bf16 = bool((ds_config.get("bf16") or {}).get("enabled"))
    return WHOLE_REPLICA_CAPABILITIES if zero >= 1 or bf16 else CAPABILITIES


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
