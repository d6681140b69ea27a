"""Tensor parallelism inside torch_native's pipeline stages, one TP degree per stage.

Each stage of a plan runs on its TP group (``plan.tp_groups[0][s]``): its modules are
parallelised with DTensor (``parallelize_module`` over a one-dimensional ``("tp",)``
mesh of that group) after the model's own TP plan — a Hugging Face model's
``config.base_model_tp_plan`` ("colwise" / "rowwise" per module path, heads and KV heads
split with the projections) — or a plan the user gives (``initialize(..., tp_plan=)``,
torch ``ParallelStyle`` objects or those names). Degrees may differ between stages
(heterogeneous TP): the Scheduler shrinks only the TP group that lost a device.

Between stages of degrees ``a`` (sender) and ``b`` (receiver) every boundary tensor is
whole on each member of a TP group (a stage's output and its input gradient are
replicated by the plan's row-wise layers and DTensor's input redistribution), so the
receiver of TP index ``u`` takes the whole tensor from the sender of index ``u mod a``;
a sender of index ``t`` sends to every receiver ``u`` with ``u mod a == t`` (none
when ``t >= b``). The gradients go the same way back. :class:`TPStage` is torch's own
``PipelineStage`` with exactly these peers for its warm-up vote, metadata inference and
P2P operations; everything else (the lowered action lists, the runtime) is the engine's.
(The paper's bandwidth rule, each sender sending one chunk and the receivers gathering,
is not used: on CPU the whole tensor is the simpler, exact choice.)

State. A TP rank holds a shard of its stage's sharded parameters and their optimizer
state. To survive the loss of a TP peer without a checkpoint, each rank also keeps the
whole stage state as it stood after every optimizer step (:func:`gather_full`: one
all-gather of every shard over the TP group at the end of the iteration): any surviving
member can re-shard the stage by fully qualified name onto any new degree. That costs a
copy of the stage's state per TP rank in host memory and one all-gather per iteration.

Profiles. A TP rank on the host times its compute chunks by busy time
(:class:`BusyTimer`), not wall time: a slow member's peers wait for it inside their own
chunks' collectives, and only the busy time tells the slow one apart.

Limits: TP runs with one replica (``dp = 1``: no FSDP, no cross-replica reduction over
different TP layouts; the plugin declares ``tp_with_dp = False``); embeddings and the
head stay replicated (only the base model's plan is applied). docs/torch_native.md,
"Tensor parallelism".
"""

from __future__ import annotations

import fnmatch
import os
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

import torch.distributed.tensor.parallel  # noqa: F401 - imported before any group exists (engine._EARLY)
from resihp_core.plan import ParallelPlan
from resihp_core.runtime.session import join_members, rendezvous_store
from resihp_adapters.torchkit.device import ChunkTimer
from resihp_adapters.torch_native.engine import (
    Held, IterationResult, TorchNativeEngine, _default_timeout, place_of, tie_sets)

__all__ = ["TPStage", "TPEngine", "BusyTimer", "Peers", "model_tp_plan", "tp_styles", "uses_tp", "check_tp_plan",
           "executor_ranks", "stage_peers", "gather_full", "local_part"]

#: Hugging Face TP plan names this adapter maps to torch styles.
STYLES = ("colwise", "rowwise")


def uses_tp(plan: ParallelPlan) -> bool:
    """Whether ``plan`` runs some stage on more than one device."""
    return any(len(g) > 1 for rep in plan.tp_groups for g in rep)


def executor_ranks(plan: ParallelPlan) -> dict[tuple[int, int, int], int]:
    """(replica, stage, TP index) -> world rank, stage-major (equal to the engine's
    ``stage * dp + replica`` when every degree is 1)."""
    out: dict[tuple[int, int, int], int] = {}
    for s in range(plan.pp):
        for r in range(plan.dp):
            for t, _ in enumerate(plan.group(r, s)):
                out[(r, s, t)] = len(out)
    return out


def model_tp_plan(source: nn.Module, given: Mapping[str, object] | None = None) -> dict[str, object]:
    """The TP plan by module path of the user's model: ``given``, else the model's own
    (a Hugging Face config's ``base_model_tp_plan``, its paths under the base model's
    prefix). Raises naming the model when it has neither."""
    if given is not None:
        return dict(given)
    cfg = getattr(source, "config", None)
    base = getattr(cfg, "base_model_tp_plan", None)
    if not base:
        raise ValueError(f"{type(source).__name__} carries no TP plan (config.base_model_tp_plan); pass one: "
                         "initialize(..., tp_plan={'model.layers.*.mlp.up_proj': 'colwise', ...})")
    prefix = getattr(source, "base_model_prefix", "") or ""
    if prefix and not hasattr(source, prefix):
        prefix = ""
    return {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}


def tp_styles(plan: Mapping[str, object]) -> dict[str, object]:
    """Plan entries as torch ``ParallelStyle`` objects ("colwise" -> ``ColwiseParallel``,
    "rowwise" -> ``RowwiseParallel``); any other name is refused with its path."""
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    out: dict[str, object] = {}
    for path, style in plan.items():
        if isinstance(style, ParallelStyle):
            out[path] = style
        elif style == "colwise":
            out[path] = ColwiseParallel()
        elif style == "rowwise":
            out[path] = RowwiseParallel()
        else:
            raise ValueError(f"tp_plan[{path!r}] = {style!r}: torch_native maps {list(STYLES)} "
                             "(or give a torch ParallelStyle)")
    return out


def _sharded_sizes(source: nn.Module, plan: Mapping[str, object]) -> dict[str, tuple[str, int]]:
    """Per planned Linear: (its style name, the size the style splits)."""
    out = {}
    for name, mod in source.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern) and isinstance(mod, nn.Linear):
                kind = style if isinstance(style, str) else type(style).__name__
                colwise = kind in ("colwise", "ColwiseParallel")
                out[name] = (kind, mod.out_features if colwise else mod.in_features)
    return out


def check_tp_plan(plan: ParallelPlan, source: nn.Module | None, tp_plan: Mapping[str, object] | None) -> None:
    """What this adapter runs with TP: one replica, no migration, and every degree
    dividing the attention heads, the KV heads and every size the plan splits."""
    if plan.dp != 1:
        raise ValueError(f"torch_native runs tensor parallelism with one replica (dp = 1), the plan has dp = "
                         f"{plan.dp} (FSDP over replicas of different TP layouts is not implemented)")
    if plan.migrations:
        raise ValueError("torch_native cannot run migrated work (one schedule drives one replica's pipeline)")
    if source is None or tp_plan is None:
        raise ValueError("tensor parallelism needs a model with a TP plan (initialize(model, ...) with a Hugging "
                         "Face model, or tp_plan=...)")
    cfg = getattr(source, "config", None)
    heads = {"num_attention_heads": getattr(cfg, "num_attention_heads", None),
             "num_key_value_heads": getattr(cfg, "num_key_value_heads", None)}
    sizes = _sharded_sizes(source, tp_plan)
    for s in range(plan.pp):
        d = plan.degree(0, s)
        for key, n in heads.items():
            if isinstance(n, int) and n % d:
                raise ValueError(f"stage {s}: TP degree {d} does not divide config.{key} = {n}")
        for name, (kind, n) in sizes.items():
            if n % d:
                raise ValueError(f"stage {s}: TP degree {d} does not divide {name} ({kind}, size {n})")


@dataclass(frozen=True)
class Peers:
    """The world ranks a stage's TP rank exchanges boundary tensors with: one sender per
    neighbour stage it receives from, the receivers it sends to (see module docstring)."""

    recv_from: dict[int, int] = field(default_factory=dict)  # neighbour stage -> rank
    send_to: dict[int, list[int]] = field(default_factory=dict)  # neighbour stage -> ranks


def stage_peers(plan: ParallelPlan, replica: int, stage: int, tp_index: int) -> Peers:
    """Peers of TP rank ``tp_index`` of ``stage`` (the rule of the module docstring)."""
    ranks = executor_ranks(plan)
    me = plan.degree(replica, stage)
    recv, send = {}, {}
    for nb in (stage - 1, stage + 1):
        if not 0 <= nb < plan.pp:
            continue
        other = plan.degree(replica, nb)
        recv[nb] = ranks[(replica, nb, tp_index % other)]
        send[nb] = [ranks[(replica, nb, u)] for u in range(other) if u % me == tp_index]
    return Peers(recv, send)


class TPStage(PipelineStage):
    """torch's ``PipelineStage`` whose neighbours are TP groups of any degree: its pipeline
    rank is its stage index and every exchange goes to :class:`Peers` (world ranks)."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device,
                 group: dist.ProcessGroup, peers: Peers) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self.group_rank, self.group_size = stage_index, num_stages  # the runtime runs action list `group_rank`
        self.stage_index_to_group_rank = {i: i for i in range(num_stages)}
        self.peers = peers

    def _resolve_peer_global_rank(self, stage_idx: int) -> int:
        # Only torch's send builders call this (their ops are re-addressed below).
        return dist.get_rank()

    def _get_recv_ops(self, recv_infos) -> list[dist.P2POp]:  # noqa: ANN001 - torch's _RecvInfo tuple
        return [dist.P2POp(dist.irecv, info.buffer, self.peers.recv_from[info.source])
                for info in recv_infos if not info.is_root_arg and info.buffer is not None]

    def _fan_out(self, ops: list[dist.P2POp], stage: int) -> list[dist.P2POp]:
        return [dist.P2POp(dist.isend, op.tensor, peer) for op in ops for peer in self.peers.send_to.get(stage, [])]

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._fan_out(super().get_fwd_send_ops(fwd_chunk_id), self.stage_index + 1)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._fan_out(super().get_bwd_send_ops(bwd_chunk_id), self.stage_index - 1)

    def _recv_meta(self, src_stage: int) -> object:
        objects: list[object] = [None]
        dist.recv_object_list(objects, src=self.peers.recv_from[src_stage], device=self.device)
        return objects[0]

    def _send_meta(self, meta: object, dst_stage: int) -> None:
        for peer in self.peers.send_to.get(dst_stage, []):
            dist.send_object_list([meta], dst=peer, device=self.device)

    def _warmup_forward_vote(self, has_backward: bool, received_acc: Tensor | None = None) -> Tensor:
        from torch.distributed.pipelining.stage import InferenceMode

        vote = 0 if InferenceMode.needs_dynamic(self._user_meta, has_backward) else 1
        acc = torch.tensor([vote], dtype=torch.int32, device=self.device)
        if not self.is_first:
            got = torch.zeros(1, dtype=torch.int32, device=self.device)
            dist.recv(got, src=self.peers.recv_from[self.stage_index - 1])
            acc = acc * got
        if not self.is_last:
            for peer in self.peers.send_to.get(self.stage_index + 1, []):
                dist.send(acc, dst=peer)
        return acc

    def _warmup_backward_result(self, received_result: Tensor | None = None) -> Tensor:
        if self.is_last:
            result = received_result
        else:
            result = torch.zeros(1, dtype=torch.int32, device=self.device)
            dist.recv(result, src=self.peers.recv_from[self.stage_index + 1])
        if not self.is_first:
            for peer in self.peers.send_to.get(self.stage_index - 1, []):
                dist.send(result, dst=peer)
        return result


# ------------------------------------------------------------------ state
def _is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _shard_dim(t: Tensor) -> int | None:
    """The dimension a DTensor is sharded on over its (1-D) mesh; None if whole."""
    from torch.distributed.tensor import Shard

    if not _is_dtensor(t):
        return None
    (pl,) = t.placements
    return pl.dim if isinstance(pl, Shard) else None


def local_part(full: Tensor, like: Tensor) -> Tensor:
    """This rank's part of ``full`` laid out as ``like`` (a parameter: DTensor or plain)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not _is_dtensor(like):
        return full.clone()
    d = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    # its own storage: the local piece may be a view of ``full``, which is kept as the
    # whole-stage state and must not follow the optimizer's in-place updates
    return DTensor.from_local(d.to_local().clone(), d.device_mesh, d.placements, run_check=False,
                              shape=d.shape, stride=d.stride())


def gather_full(module: nn.Module, optimizer: torch.optim.Optimizer, aliases: Mapping[str, str],
                group: dist.ProcessGroup | None, degree: int) -> dict[str, Held]:
    """The whole stage state by state name (parameters and optimizer state), from one
    all-gather over the TP ``group`` of every rank's local pieces; whole tensors (norms,
    step counts) are taken from TP rank 0, so every member keeps the same bits."""
    entries: list[tuple[str, str, Tensor, int | None]] = []  # (name, key, local, shard dim)
    other: dict[str, dict[str, object]] = {}
    for name, p in module.named_parameters():
        canon = aliases.get(name, name)
        if any(e[0] == canon for e in entries):
            continue
        dim = _shard_dim(p)
        entries.append((canon, "", p.to_local() if _is_dtensor(p) else p, dim))
        other[canon] = {}
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, Tensor) and v.dim() > 0:
                entries.append((canon, k, v.to_local() if _is_dtensor(v) else v, _shard_dim(v)))
            else:
                other[canon][k] = v.detach().clone() if isinstance(v, Tensor) else v
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for _, _, t, _ in entries]) if entries else \
        torch.zeros(0, dtype=torch.float64)
    if degree > 1:
        parts = [torch.empty_like(flat) for _ in range(degree)]
        dist.all_gather(parts, flat, group=group)
    else:
        parts = [flat]
    out: dict[str, Held] = {}
    offset = 0
    for name, key, t, dim in entries:
        n = t.numel()
        pieces = [q[offset:offset + n].view(t.shape).to(t.dtype) for q in parts]
        offset += n
        whole = torch.cat(pieces, dim) if dim is not None else pieces[0].clone()
        if key == "":
            out[name] = Held(whole, {}, other[name])
        else:
            out[name].sharded[key] = whole
    return out


class BusyTimer(ChunkTimer):
    """Times a TP chunk on the host by the training thread's busy time: CPU time plus the
    time it was runnable but waited for a CPU (``/proc/self/task/<tid>/schedstat``), i.e. the
    wall time without the time it slept in a TP collective waiting for a peer. A rank
    slowed by itself shows its own slowdown; its TP peers, which wait for it inside every
    row-wise all-reduce, do not (docs/torch_native.md, "Tensor parallelism": slow TP
    ranks). Falls back to the wall clock where schedstat is missing."""

    _fd: tuple[int, int] | None = None  # (thread id, its schedstat file): one thread runs the chunks
    _missing = False

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self._b0: float | None = None

    @classmethod
    def _busy(cls) -> float | None:
        if cls._missing:
            return None
        try:
            tid = threading.get_native_id()
            if cls._fd is None or cls._fd[0] != tid:
                if cls._fd is not None:
                    os.close(cls._fd[1])
                cls._fd = (tid, os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY))
            cpu, delay = os.pread(cls._fd[1], 128, 0).split()[:2]
            return (int(cpu) + int(delay)) / 1e9
        except (OSError, ValueError):
            cls._missing = True
            return None

    def start(self) -> ChunkTimer:
        self._b0 = self._busy()
        return super().start()

    def stop(self) -> float:
        wall = super().stop()
        now = self._busy()
        return wall if now is None or self._b0 is None else min(wall, max(0.0, now - self._b0))


class TPEngine(TorchNativeEngine):
    """The engine with tensor parallelism: plans where some stage has degree > 1 run as
    described in the module docstring; every other plan runs the FSDP2 engine as it is.
    ``tp_plan``: the user's plan (None: the model's own)."""

    def __init__(self, *args: object, tp_plan: Mapping[str, object] | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.user_tp_plan = tp_plan
        self.tp = False  # this generation runs the TP path
        self.tp_group: dist.ProcessGroup | None = None
        self._ties_tp: list[tuple[dist.ProcessGroup | None, str]] = []  # (group of TP rank 0s, name)
        self._full: dict[int, dict[str, Held]] = {}  # optimizer steps -> the whole stage state

    # ------------------------------------------------------------ plan
    def _tp_plan(self) -> dict[str, object] | None:
        source = getattr(self.model, "source", None)
        if source is None:
            return dict(self.user_tp_plan) if self.user_tp_plan is not None else None
        given = self.user_tp_plan if self.user_tp_plan is not None else getattr(self.model, "tp_plan", None)
        try:
            return model_tp_plan(source, given)
        except ValueError:
            return None

    def check(self, plan: ParallelPlan) -> None:
        """Raise, naming the cause, when ``plan`` needs TP this model cannot run."""
        if uses_tp(plan):
            check_tp_plan(plan, getattr(self.model, "source", None), self._tp_plan())

    # ------------------------------------------------------------ generations
    def release(self) -> None:
        self.tp_group = None
        self._ties_tp = []
        super().release()
        self.tp = False

    def rebuild(self, plan: ParallelPlan, generation: int, devices: list[int] | None = None) -> None:
        if not uses_tp(plan):
            self._full = {}
            return super().rebuild(plan, generation, devices)
        from torch.distributed.device_mesh import DeviceMesh

        self.check(plan)
        self.release()
        self.tp = True
        self.plan, self.generation = plan, generation
        self.place = place_of(plan, self.device, self.wanted_shard)
        ranks = executor_ranks(plan)
        executors = len(ranks)
        others = sorted(set(devices if devices is not None else plan.devices()) - set(plan.devices()))
        self.rank_of = {d: place_of(plan, d, self.wanted_shard).rank for d in plan.devices()}
        self.rank_of.update({d: executors + i for i, d in enumerate(others)})
        if self.device not in self.rank_of:
            raise ValueError(f"device {self.device} is not among generation {generation}'s devices")
        world, rank = len(self.rank_of), self.rank_of[self.device]
        prefix = rendezvous_store(self.store, generation)
        join_members(prefix, rank, self.device, world, self.join_timeout)
        pl = self.place
        lane = None
        with _default_timeout(self.timeout):
            dist.init_process_group(self.placement.init_backend, store=prefix, rank=rank, world_size=world, timeout=self.timeout)
            # Every rank takes part in creating every group, standbys included.
            for s in range(plan.pp):
                g = dist.new_group([ranks[(0, s, t)] for t in range(plan.degree(0, s))], timeout=self.timeout)
                if pl is not None and pl.stage == s:
                    self.tp_group = g
            for t in range(max(plan.degree(0, s) for s in range(plan.pp))):
                g = dist.new_group([ranks[(0, s, t)] for s in range(plan.pp) if plan.degree(0, s) > t],
                                   timeout=self.timeout)
                if pl is not None and pl.tp_index == t:
                    lane = g  # only to construct the stage (TPStage addresses its own peers)
            self.executors_group = None if world == executors else dist.new_group(
                list(range(executors)), timeout=self.timeout)
            for stages, where in tie_sets(self.model, plan):
                g = dist.new_group([ranks[(0, s, 0)] for s in stages], timeout=self.timeout)
                if pl is not None and pl.stage in where:
                    self._ties_tp.append((g if pl.tp_index == 0 else None, where[pl.stage]))
        self._lane = lane
        if pl is not None:
            self.mesh = DeviceMesh.from_group(self.tp_group, self.placement.device.type, mesh_dim_names=("tp",))
            self._bound[0].append(self.mesh)
        else:
            self.mesh = None

    def _wrap(self, module: nn.Module) -> None:
        if not self.tp:
            return super()._wrap(module)
        from torch.distributed.tensor.parallel import parallelize_module

        plan, pl = self.plan, self.place
        if pl.tp_degree > 1:
            with _default_timeout(self.timeout):
                parallelize_module(module, self.mesh, tp_styles(self._tp_plan()))
        self.module = module
        self._copy_plans = {}
        self.optimizer = self.recipe.optimizer(list(module.parameters()))
        self._base_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self._make_scheduler()
        self.stage = TPStage(module, pl.stage, plan.pp, self.placement.device, self._lane,
                             stage_peers(plan, pl.replica, pl.stage, pl.tp_index))
        self._hook_stage(self.stage)
        self.schedule = None

    def _whole(self, module: nn.Module) -> dict[str, Held]:
        return {self.canonical(n): Held(p.detach().clone()) for n, p in module.named_parameters()}

    def start_fresh(self) -> None:
        if not self.tp:
            return super().start_fresh()
        self.iteration = 0
        if self.place is None:
            return
        module = self._build()
        self._full = {0: self._whole(module)}
        self._wrap(module)

    def install(self, full: dict[str, Held], step: int) -> None:
        if not self.tp:
            return super().install(full, step)
        self.iteration = step
        if self.place is None:
            return
        module = self._build()
        with torch.no_grad():
            for name, p in module.named_parameters():
                key = self.canonical(name)
                if key not in full:
                    raise KeyError(f"device {self.device}: no state for parameter {key!r}")
                p.copy_(full[key].param)
        self._wrap(module)
        mine = {}
        for name, p in self.module.named_parameters():
            h = full[self.canonical(name)]
            mine[self.canonical(name)] = h
            if not h.sharded and not h.other:
                continue
            st = {k: local_part(v, p) for k, v in h.sharded.items()}
            st.update({k: (v.clone() if isinstance(v, Tensor) else v) for k, v in h.other.items()})
            self.optimizer.state[p] = st
        self._full = {step: mine}

    def load_checkpoint(self, path: str, step: int) -> None:
        super().load_checkpoint(path, step)
        if self.tp and self.module is not None:
            self._full = {step: self._gather()}

    def chunk_timer(self) -> ChunkTimer:
        """TP stages on the host: busy time (:class:`BusyTimer`); else the placement's."""
        if self.tp and self.place is not None and self.place.tp_degree > 1 and self.placement.device.type == "cpu":
            return BusyTimer()
        return super().chunk_timer()

    # ------------------------------------------------------------ state
    def _gather(self) -> dict[str, Held]:
        return gather_full(self.module, self.optimizer, self.model.aliases, self.tp_group, self.place.tp_degree)

    def local_shards(self, params: Iterable[tuple[str, Tensor]] | None = None, *,
                     copy: bool = True) -> dict[str, Held]:
        """TP path: the whole stage state after the last optimizer step (what any member
        of the TP group can hand on), always copied; no communication."""
        if not self.tp or self.module is None:
            return super().local_shards(params, copy=copy)
        import copy as copying

        have = self._full.get(self.iteration)
        if have is None:
            raise RuntimeError(f"device {self.device}: no whole stage state for step {self.iteration}")
        return {n: Held(h.param.clone(), {k: v.clone() for k, v in h.sharded.items()}, copying.deepcopy(h.other))
                for n, h in have.items()}

    def full_state(self) -> dict[str, Held]:
        if not self.tp:
            return super().full_state()
        return self.local_shards()

    # ------------------------------------------------------------ execution
    def finish_grads(self) -> float | None:
        """TP path: tied copies summed between the stages' TP rank 0s, then handed to their
        TP peers; the norm counts sharded gradients on every rank and whole ones once."""
        if not self.tp:
            return super().finish_grads()
        params = dict(self.module.named_parameters())
        for group, name in self._ties_tp:
            g = params[name].grad
            if g is None:
                continue
            local = g.to_local() if _is_dtensor(g) else g
            if group is not None:
                dist.all_reduce(local, group=group)
            if self.place.tp_degree > 1:
                dist.broadcast(local, group_src=0, group=self.tp_group)
        if self.recipe.max_grad_norm is None:
            return None
        return clip_tp(self.module, self.model.aliases, self.recipe.max_grad_norm, self.executors_group,
                       self.place.tp_index)

    def defer_steps(self, on: bool) -> bool:
        """Not on the TP path: its full copy of each step's state is gathered right after the step."""
        return super().defer_steps(on and not self.tp)

    def run(self, program, iteration: int | None = None) -> IterationResult:  # noqa: ANN001 - core Program
        res = super().run(program, iteration)
        if self.tp:
            self._full = {k: v for k, v in self._full.items() if k >= self.iteration - 1}
            self._full[self.iteration] = self._gather()
        return res


def clip_tp(module: nn.Module, aliases: Mapping[str, str], max_norm: float, group: dist.ProcessGroup | None,
            tp_index: int) -> float:
    """:func:`~.engine.clip_global` for TP stages: squares of sharded gradients summed on
    every TP rank, of whole (replicated) ones on TP rank 0 only, over every executor."""
    sq = torch.zeros((), dtype=torch.float64)
    for n, p in module.named_parameters():
        if p.grad is None or n in aliases:
            continue
        if _shard_dim(p) is None and tp_index != 0:
            continue
        g = p.grad.to_local() if _is_dtensor(p.grad) else p.grad
        sq += g.detach().to(torch.float64).pow(2).sum()
    dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef < 1.0:
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    (p.grad.to_local() if _is_dtensor(p.grad) else p.grad).mul_(coef)
    return norm

