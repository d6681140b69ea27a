"""Megatron-Core's training state by layout-independent names, and the arithmetic that
moves it between layouts.

A stage's ``GPTModel`` names its decoder layers from 0; here every parameter gets its
global name (``decoder.layers.<global index>.…``), the tied output weight of a last
stage is the word embedding it copies, and each name belongs to a *component* (the unit
:func:`resihp_adapters.torchkit.transfer.transfer_plan` moves): ``embed.word``,
``embed.pos``, ``layers.<i>``, ``head``. A parameter's TP sharding is Megatron's own
(``tensor_model_parallel`` / ``partition_dim`` attributes); a gated MLP's ``linear_fc1``
holds two shards per rank (gate and up), moved as two pieces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from resihp_core.plan import ParallelPlan

__all__ = ["Entry", "canonical", "component_of", "components_of_stage", "pieces", "overlap", "take", "FIELDS"]

#: The tensors kept per parameter: the weight and Adam's two moments.
FIELDS = ("param", "exp_avg", "exp_avg_sq")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


@dataclass
class Entry:
    """One parameter this device holds: its tensors (``FIELDS``), TP sharding
    (``dim`` None: replicated) and this rank's place in it, and whether it is a gated
    ``linear_fc1`` (two pieces per rank)."""

    tensors: list[Tensor]
    dim: int | None
    rank: int
    size: int
    gated: bool = False


def canonical(local: str, first_layer: int, pre_process: bool, tied: bool) -> str:
    """The layout-independent name of a stage's parameter ``local``."""
    m = _LAYER.match(local)
    if m:
        return f"decoder.layers.{first_layer + int(m.group(1))}.{m.group(2)}"
    if local == "output_layer.weight" and tied and not pre_process:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    return local


def component_of(name: str) -> str:
    m = _LAYER.match(name)
    if m:
        return f"layers.{m.group(1)}"
    if name.startswith("embedding.word_embeddings"):
        return "embed.word"
    if name.startswith("embedding."):
        return "embed.pos"
    return "head"


def components_of_stage(tied: bool, has_position: bool) -> Callable[[ParallelPlan, int], list[str]]:
    """``(plan, stage) -> [component]`` for :func:`transfer_plan`."""

    def of(plan: ParallelPlan, s: int) -> list[str]:
        a, b = plan.layer_ranges[s]
        out = [f"layers.{i}" for i in range(a, b)]
        if s == 0:
            out += ["embed.word"] + (["embed.pos"] if has_position else [])
        if s == plan.pp - 1:
            out.append("head")
            if tied and s != 0:
                out.append("embed.word")
        return sorted(set(out))

    return of


def pieces(t: Tensor, e: Entry) -> list[Tensor]:
    """Views of ``t`` that are each sharded like a plain TP tensor along ``e.dim``."""
    return list(t.chunk(2, 0)) if e.gated else [t]


def overlap(full: int, src: int, k_src: int, dst: int, k_dst: int) -> tuple[int, int, int] | None:
    """Where shard ``src`` of ``k_src`` and shard ``dst`` of ``k_dst`` of a dimension of
    ``full`` overlap: (offset in the source shard, offset in the destination shard,
    length), or None."""
    a0, a1 = src * full // k_src, (src + 1) * full // k_src
    b0, b1 = dst * full // k_dst, (dst + 1) * full // k_dst
    lo, hi = max(a0, b0), min(a1, b1)
    if lo >= hi:
        return None
    return lo - a0, lo - b0, hi - lo


def take(e: Entry, field: int, piece: int, off: int, length: int) -> Tensor:
    """A view of tensor ``field`` of ``e``: piece ``piece``, ``length`` values from
    ``off`` along the TP dimension (``off`` < 0: the whole piece)."""
    t = pieces(e.tensors[field], e)[piece]
    return t if off < 0 else t.narrow(e.dim, off, length)
