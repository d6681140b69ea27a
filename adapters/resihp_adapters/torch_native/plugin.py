"""Entry point ``torch_native``: registers the torch.distributed.pipelining + FSDP2 adapter.

Registration is lazy: this module imports neither torch nor the adapter module. The
adapter class declares ``capabilities = CAPABILITIES`` from here.

What it promises (each proven by the conformance kit, ``tests/conformance``): any
layer boundaries between generations (stages are rebuilt, state moves by parameter
name), GPipe / 1F1B / ZB-H1 (torch's own F, B, I, W actions), checkpoints
(``torch.distributed.checkpoint``, re-sharded onto any later layout), uneven
micro-batch counts per replica (``uneven_dp``: another replica's micro-batch run whole
by one replica's pipeline; a dropped replica), and tensor parallelism with a TP degree
per stage (DTensor; a TP group shrinks alone, its state re-sharded from any surviving
member's memory) with one replica only (``tp_with_dp = False``: the Scheduler never
plans TP x DP for it; ``tp.py``). Not promised: a single stage migrated to
another replica — a torch pipeline schedule drives one replica's pipeline group, so a
stage cannot take a micro-batch from another replica's previous stage
(``docs/torch_native.md``).
"""

from __future__ import annotations

from resihp_core.adapter import AdapterRegistry, Capabilities
from resihp_core.hookspecs import hookimpl
from resihp_core.plan import ScheduleKind

NAME = "torch_native"
TARGET = "resihp_adapters.torch_native.adapter:TorchNativeAdapter"
CAPABILITIES = Capabilities(
    tp_resize=True,
    heterogeneous_tp=True,
    layer_repartition=True,
    cross_replica_migration=False,
    uneven_dp=True,  # another replica's micro-batch runs whole on one pipeline (lowering.py)
    schedules=frozenset({ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1}),
    checkpoint=True,
    tp_with_dp=False,  # TP with one replica: no DP reduction across TP layouts (tp.py)
    sdc_fingerprint=True,  # HSDP replicate groups compare their shards (docs/sdc.md)
    restage=True,  # whole replicas of another depth: every stage rebuilt, state moved or restored
)


@hookimpl(trylast=True)
def resihp_register_adapters(registry: AdapterRegistry) -> None:
    """First-party default (``trylast``): a plugin may register its own ``torch_native``."""
    registry.register(
        NAME,
        TARGET,
        CAPABILITIES,
        description="torch.distributed.pipelining stages sharded with FSDP2/HSDP (PP x DP), or DTensor TP per stage",
        install_hint="pip install 'resihp[torch]'",
        job_config="resihp_adapters.torch_native.plugin:job_section",
        reference="resihp_adapters.torch_native.reference:reference_losses",
    )


def job_section(cfg) -> dict:
    """This adapter's job section for ``resihp run`` / ``resihp launch``: the LLaMA of
    ``[model]`` (layers, hidden, heads, ffn_hidden, vocab), dtype, seed and learning rate
    of ``[training]``; ``[adapter]`` may add ``shard`` (FSDP shard degree; default 0 = all
    replicas), ``weight_decay``, or override ``model`` fields. The data is the job's
    ``[data]`` source (one packed sequence of ``training.token_budget`` tokens per
    micro-batch)."""
    mod, tr = cfg.model, cfg.training
    par = getattr(cfg, "parallel", None)
    if par is not None and par.tp > 1 and par.dp > 1:
        raise ValueError(f"parallel: torch_native runs tensor parallelism with one replica (tp = {par.tp}, "
                         f"dp = {par.dp}): its DP reduction does not span replicas of different TP layouts. "
                         "Use dp = 1 with tp > 1, or tp = 1 with dp > 1 (FSDP2/HSDP); docs/torch_native.md, "
                         "Tensor parallelism")
    extra = dict(cfg.adapter)
    unknown = sorted(set(extra) - {"shard", "weight_decay", "model"})
    if unknown:
        raise ValueError(f"adapter: unknown field(s) {unknown} for torch_native "
                         "(known: model, shard, weight_decay; the data is the [data] section)")
    model = dict(vocab_size=mod.vocab, dim=mod.hidden, n_layers=mod.layers, n_heads=mod.heads,
                 ffn_dim=mod.ffn, dtype=tr.dtype, seed=tr.seed, **extra.pop("model", {}))
    return {"model": model, "lr": tr.lr, "backend": cfg.runtime.backend,
            "devices_per_node": cfg.runtime.devices_per_node, **extra}
