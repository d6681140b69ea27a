"""Move FSDP2 shards between plan generations, from the survivors' memory.

Old layout: stage ``s`` of the old plan is FSDP-sharded ``k`` ways (dim 0, in torch.chunk
order, as FSDP2 does); replica ``r`` holds chunk ``r % k``, so under HSDP (``k`` < the
replicas) each chunk lives on ``dp / k`` devices. New layout: any stage boundaries, any
number of replicas. Every device of the new plan needs, for each parameter of its new
stage, the full parameter and both AdamW moments; it then keeps its own new shard
(:meth:`~.engine.TorchNativeEngine.install`).

:func:`transfer_plan` is computed identically by every device from the two plans and the
alive devices, so no negotiation is needed: for each (parameter, old chunk, receiver)
one surviving holder sends, itself when the receiver holds the chunk, otherwise
holders in turn (spreading the load). When every holder of some chunk is dead the
state is lost in memory: :class:`StateLost` says which, and the job restores from a
``torch.distributed.checkpoint`` checkpoint instead.

Cost: each receiver gets three full tensors (parameter, exp_avg, exp_avg_sq) per
parameter of its stage — the stage's state times three — from up to ``k`` senders.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import Tensor

from resihp_core.adapter import StateLost as _ContractStateLost
from resihp_core.plan import ParallelPlan
from resihp_adapters.torch_native.engine import Shards, place_of
from resihp_adapters.torch_native.model import LlamaConfig, StageModel

__all__ = ["StateLost", "Transfer", "transfer_plan", "exchange", "chunk_rows", "full_shapes"]


class StateLost(_ContractStateLost):
    """Every device holding some shard is dead: restore from a checkpoint (the
    contract's state-lost signal, which the supervisor acts on)."""


@dataclass(frozen=True, order=True)
class Transfer:
    dst: int  # device
    name: str
    chunk: int  # old FSDP chunk index
    of: int  # old shard degree of that parameter's stage
    src: int  # device


@lru_cache(maxsize=8)
def full_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape by name (built on the meta device, no memory)."""
    with torch.device("meta"):
        model = StageModel(cfg, 0, cfg.n_layers)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def chunk_rows(rows: int, n: int) -> list[int]:
    """Rows of each of ``n`` dim-0 shards, FSDP2's way (torch.chunk, empty tail shards)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(n)]
    return sizes + [0] * (n - len(sizes))


def _stage_of(plan: ParallelPlan, name: str) -> int:
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(s for s, (a, b) in enumerate(plan.layer_ranges) if a <= layer < b)
    return plan.pp - 1


def _names(cfg: LlamaConfig, plan: ParallelPlan, stage: int) -> list[str]:
    a, b = plan.layer_ranges[stage]
    keep = []
    for name in full_shapes(cfg):
        if _stage_of(plan, name) == stage:
            keep.append(name)
    return keep


def transfer_plan(cfg: LlamaConfig, old_plan: ParallelPlan, new_plan: ParallelPlan,
                  alive: set[int] | frozenset[int], wanted_shard: int) -> list[Transfer]:
    """Who sends which old chunk of which parameter to whom (see the module docstring)."""
    holders: dict[tuple[int, int], list[int]] = {}
    degree: dict[int, int] = {}
    for d in sorted(alive):
        pl = place_of(old_plan, d, wanted_shard)
        if pl is not None:
            holders.setdefault((pl.stage, pl.shard_index), []).append(d)
            degree[pl.stage] = pl.shard_degree
    out: list[Transfer] = []
    for dst in sorted(new_plan.devices()):
        pl = place_of(new_plan, dst, wanted_shard)
        for name in _names(cfg, new_plan, pl.stage):
            s_old = _stage_of(old_plan, name)
            k = degree.get(s_old)
            if k is None:
                raise StateLost(f"stage {s_old} of the old plan has no surviving device ({name})")
            for c in range(k):
                hs = holders.get((s_old, c), [])
                if not hs:
                    raise StateLost(
                        f"shard {c}/{k} of stage {s_old} ({name}) was held only by dead devices"
                    )
                src = dst if dst in hs else hs[dst % len(hs)]
                out.append(Transfer(dst, name, c, k, src))
    return sorted(out)


def _numel(cfg: LlamaConfig, tr: Transfer) -> int:
    shape = full_shapes(cfg)[tr.name]
    rows = chunk_rows(shape[0], tr.of)[tr.chunk]
    rest = 1
    for x in shape[1:]:
        rest *= x
    return rows * rest


def exchange(cfg: LlamaConfig, plan: list[Transfer], me: int, rank_of: dict[int, int],
             local: dict[str, Shards]) -> tuple[dict[str, Shards], int]:
    """Run this device's part of ``plan`` over the default group (one message per
    sender/receiver pair); returns the full tensors this device needs and bytes received."""
    dtype = cfg.torch_dtype
    shapes = full_shapes(cfg)
    to: dict[int, list[Transfer]] = {}
    frm: dict[int, list[Transfer]] = {}
    for tr in plan:
        if tr.src == me and tr.dst != me:
            to.setdefault(tr.dst, []).append(tr)
        if tr.dst == me and tr.src != me:
            frm.setdefault(tr.src, []).append(tr)
    works, bufs = [], {}
    for dst, trs in sorted(to.items()):
        flat = torch.cat([t.reshape(-1) for tr in trs for t in local[tr.name]]).to(dtype)
        works.append(dist.isend(flat, rank_of[dst], tag=1))
    for src, trs in sorted(frm.items()):
        buf = torch.empty(3 * sum(_numel(cfg, tr) for tr in trs), dtype=dtype)
        works.append(dist.irecv(buf, rank_of[src], tag=1))
        bufs[src] = buf
    for w in works:
        w.wait()
    pieces: dict[str, dict[int, tuple[Tensor, Tensor, Tensor]]] = {}
    nbytes = 0
    for src, trs in frm.items():
        buf, off = bufs[src], 0
        nbytes += buf.numel() * buf.element_size()
        for tr in trs:
            n = _numel(cfg, tr)
            rows = chunk_rows(shapes[tr.name][0], tr.of)[tr.chunk]
            shape = (rows, *shapes[tr.name][1:])
            three = tuple(buf[off + i * n: off + (i + 1) * n].view(shape) for i in range(3))
            pieces.setdefault(tr.name, {})[tr.chunk] = three  # type: ignore[assignment]
            off += 3 * n
    for tr in plan:
        if tr.dst == me and tr.src == me:
            pieces.setdefault(tr.name, {})[tr.chunk] = local[tr.name]
    full: dict[str, Shards] = {}
    for name, parts in pieces.items():
        order = [parts[c] for c in sorted(parts)]
        full[name] = tuple(torch.cat([p[i] for p in order], 0) for i in range(3))  # type: ignore[assignment]
    return full, nbytes
