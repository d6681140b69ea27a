"""Move FSDP2 shards between plan generations, from the survivors' memory.

Old layout: stage ``s`` of the old plan is FSDP-sharded ``k`` ways (dim 0, in torch.chunk
order, as FSDP2 does); replica ``r`` holds chunk ``r % k``, so under HSDP (``k`` < the
replicas) each chunk lives on ``dp / k`` devices. New layout: any stage boundaries, any
number of replicas. Every device of the new plan needs, for each parameter of its new
stage (by its state name: the model's own fully qualified name), the full parameter and
its optimizer state; it then keeps its own new shard
(:meth:`~.engine.TorchNativeEngine.install`). A tied parameter held by two stages (a
copy each) can come from either.

:func:`transfer_plan` is computed identically by every device from the two plans and the
alive devices, so no negotiation is needed: for each (parameter, old chunk, receiver)
one surviving holder sends, itself when the receiver holds the chunk, otherwise
holders in turn (spreading the load). When every holder of some chunk is dead the
state is lost in memory: :class:`~resihp_core.adapter.StateLost` says which, and the job
restores from a ``torch.distributed.checkpoint`` checkpoint instead.

The optimizer is the user's, so the state of a parameter is whatever it keeps: each
sender serialises its chunks (parameter, sharded state, scalar state) with
``torch.save`` and sends one message per receiver (its length first).

Cost: each receiver gets its new stage's full parameters and optimizer state from up to
``k`` senders.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import torch
import torch.distributed as dist

from resihp_core.adapter import StateLost as _ContractStateLost
from resihp_core.plan import ParallelPlan
from resihp_adapters.torch_native.engine import Held, place_of
from resihp_adapters.torch_native.model import LlamaConfig, LlamaStages, StageModel

__all__ = ["StateLost", "Transfer", "transfer_plan", "exchange", "chunk_rows", "full_shapes"]


class StateLost(_ContractStateLost):
    """Every device holding some shard is dead: restore from a checkpoint (the
    contract's state-lost signal, which the supervisor acts on)."""


class Names(Protocol):
    def stage_names(self, plan: ParallelPlan, stage: int) -> list[str]: ...


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


class _LlamaNames:
    def __init__(self, cfg: LlamaConfig) -> None:
        self.model = LlamaStages(cfg)

    def stage_names(self, plan: ParallelPlan, stage: int) -> list[str]:
        return self.model.names(*plan.layer_ranges[stage])


def transfer_plan(model: Names | LlamaConfig, old_plan: ParallelPlan, new_plan: ParallelPlan,
                  alive: set[int] | frozenset[int], wanted_shard: int) -> list[Transfer]:
    """Who sends which old chunk of which parameter to whom (see the module docstring).
    ``model`` names each stage's parameters (the engine, or the adapter's LLaMA config)."""
    names = _LlamaNames(model) if isinstance(model, LlamaConfig) else model
    holders: dict[tuple[int, int], list[int]] = {}
    degree: dict[int, int] = {}
    for d in sorted(alive):
        pl = place_of(old_plan, d, wanted_shard)
        if pl is not None:
            holders.setdefault((pl.stage, pl.shard_index), []).append(d)
            degree[pl.stage] = pl.shard_degree
    old_stages: dict[str, list[int]] = {}
    for s in range(old_plan.pp):
        for name in names.stage_names(old_plan, s):
            old_stages.setdefault(name, []).append(s)
    out: list[Transfer] = []
    for dst in sorted(new_plan.devices()):
        pl = place_of(new_plan, dst, wanted_shard)
        own = place_of(old_plan, dst, wanted_shard)
        for name in names.stage_names(new_plan, pl.stage):
            candidates = old_stages.get(name, [])
            if own is not None and own.stage in candidates:  # prefer the copy it holds
                candidates = [own.stage] + [s for s in candidates if s != own.stage]
            why = f"no stage of the old plan holds {name}"
            chosen = None
            for s_old in candidates:
                k = degree.get(s_old)
                if k is None:
                    why = f"stage {s_old} of the old plan has no surviving device ({name})"
                    continue
                lost = [c for c in range(k) if not holders.get((s_old, c))]
                if lost:
                    why = f"shard {lost[0]}/{k} of stage {s_old} ({name}) was held only by dead devices"
                    continue
                chosen = (s_old, k)
                break
            if chosen is None:
                raise StateLost(why)
            s_old, k = chosen
            for c in range(k):
                hs = holders[(s_old, c)]
                src = dst if dst in hs else hs[dst % len(hs)]
                out.append(Transfer(dst, name, c, k, src))
    return sorted(out)


def _wire(h: Held) -> dict:
    return {"param": h.param, "sharded": h.sharded, "other": h.other}


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks of one tensor in order; a single chunk is the tensor itself, not a copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def _pack(obj: object) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def exchange(plan: list[Transfer], me: int, rank_of: dict[int, int],
             local: dict[str, Held]) -> tuple[dict[str, Held], int]:
    """Run this device's part of ``plan`` over the default group (one message per
    sender/receiver pair, its length first); returns the full state this device needs
    by name, and the bytes received."""
    to: dict[int, list[Transfer]] = {}
    frm: dict[int, list[Transfer]] = {}
    for tr in plan:
        if tr.src == me and tr.dst != me:
            to.setdefault(tr.dst, []).append(tr)
        if tr.dst == me and tr.src != me:
            frm.setdefault(tr.src, []).append(tr)
    out_msgs = {dst: _pack({(tr.name, tr.chunk): _wire(local[tr.name]) for tr in trs}) for dst, trs in to.items()}
    works = []
    sizes = {src: torch.zeros(1, dtype=torch.int64) for src in frm}
    for dst, msg in sorted(out_msgs.items()):
        works.append(dist.isend(torch.tensor([msg.numel()], dtype=torch.int64), rank_of[dst], tag=1))
    for src in sorted(frm):
        works.append(dist.irecv(sizes[src], rank_of[src], tag=1))
    for w in works:
        w.wait()
    works, bufs = [], {}
    for dst, msg in sorted(out_msgs.items()):
        works.append(dist.isend(msg, rank_of[dst], tag=2))
    for src in sorted(frm):
        bufs[src] = torch.empty(int(sizes[src]), dtype=torch.uint8)
        works.append(dist.irecv(bufs[src], rank_of[src], tag=2))
    for w in works:
        w.wait()
    pieces: dict[str, dict[int, dict]] = {}
    nbytes = 0
    for src, buf in bufs.items():
        nbytes += buf.numel()
        got = torch.load(io.BytesIO(buf.numpy().tobytes()), weights_only=True, map_location="cpu")
        for (name, chunk), w in got.items():
            pieces.setdefault(name, {})[chunk] = w
    for tr in plan:
        if tr.dst == me and tr.src == me:
            pieces.setdefault(tr.name, {})[tr.chunk] = _wire(local[tr.name])
    full: dict[str, Held] = {}
    for name, parts in pieces.items():
        order = [parts[c] for c in sorted(parts)]
        first = order[0]
        full[name] = Held(_joined([p["param"] for p in order]),
                          {k: _joined([p["sharded"][k] for p in order]) for k in first["sharded"]},
                          dict(first["other"]))
    return full, nbytes
