"""The Megatron-Core adapter: ResiHP's contract (``resihp_core.adapter``) on a
``pretrain_gpt``-shaped job run by Megatron-Core's own pieces.

- **communicator rebuild**: per plan generation the old model, DDP wrapper, optimizer and
  scheduler are dropped (their tensors kept by global name, :mod:`.state`), Megatron's
  parallel state is destroyed with the default group, the plan's executors join a new
  world under ``gen{g}/`` and ``initialize_model_parallel`` builds the groups of the
  plan's TP x PP x DP (replicas with no devices are left out). Then the user's model
  provider builds this stage's ``GPTModel`` with the plan's layer split
  (``pipeline_model_parallel_layout``), wrapped in Megatron's ``DistributedDataParallel``,
  with ``get_megatron_optimizer`` and ``OptimizerParamScheduler``.
- **primitive emission**: an executor's program is run by Megatron's own 1F1B
  (``get_forward_backward_func``) over the micro-batches the program lists, then the
  Megatron optimizer steps and the scheduler advances by the global batch.
- **state**: parameters, Adam moments and step, and the scheduler's position move by
  global name from survivors (any TP degree, any layer split); with the distributed
  optimizer each DP rank's Adam shards are gathered into whole moments after every step,
  so one survivor per stage holds them all; checkpoints are Megatron-Core
  ``dist_checkpointing`` checkpoints under the project's contract (:mod:`.checkpoint`,
  ``docs/megatron_core.md``), which any layout loads.

Loss scaling follows the contract's global batch: each micro-batch's loss is multiplied
by ``m * replicas / G`` (Megatron's schedule divides by the replica's micro-batch count
``m``, its DDP by the replica count), so gradients are the global mean whatever the
split. Without CUDA the bypasses of :mod:`.cpu` are applied; on a GPU none are.
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from resihp_core.adapter import Adapter, AdapterContext, IterationResult, Shard
from resihp_core.config import ConfigError
from resihp_core.plan import ParallelPlan
from resihp_core.protocols.checkpoints import CheckpointWrite
from resihp_core.program import Forward, Program

from resihp_adapters.megatron_core import state as st
from resihp_adapters.megatron_core.build import build_training, samples_of, transformer_config
from resihp_adapters.megatron_core.plugin import CAPABILITIES, NAME
from resihp_adapters.megatron_core.spec import MegatronJob, check_supported, load_job

if TYPE_CHECKING:
    from resihp_adapters.torchkit.transfer import Transfer

__all__ = ["MegatronCoreAdapter", "megatron_rank", "live_replicas"]

Held = dict[str, st.Entry]


def live_replicas(plan: ParallelPlan) -> list[int]:
    """Replicas with devices, in order: Megatron's data-parallel ranks."""
    return [r for r in range(plan.dp) if all(plan.group(r, s) for s in range(plan.pp))]


def megatron_rank(plan: ParallelPlan, device: int) -> int:
    """This device's rank in the generation's world, in the order Megatron's
    ``initialize_model_parallel`` (``tp-cp-ep-dp-pp``) gives (TP fastest, PP slowest)."""
    r, s, t = plan.location(device)
    live = live_replicas(plan)
    tp = plan.degree(r, s)
    return t + tp * (live.index(r) + len(live) * s)


def _uniform_tp(plan: ParallelPlan) -> int:
    """The plan's one TP degree (Megatron-Core's parallel state has one TP size)."""
    degrees = {plan.degree(r, s) for r, s in plan.executors()}
    if len(degrees) != 1:
        raise ConfigError(f"plan has TP degrees {sorted(degrees)}: Megatron-Core's parallel state has one TP size",
                          path="plan.tp_groups", value=sorted(degrees))
    return degrees.pop()


def _dtype(meta: list[Any]) -> torch.dtype:
    return getattr(torch, str(meta[3]).split(".")[-1])


def _shard_numel(meta: list[Any], parts: int) -> int:
    """Values in one of ``parts`` TP shards of a parameter (``meta``: full shape, dim)."""
    n = 1
    for x in meta[0]:
        n *= int(x)
    return n // parts if meta[1] is not None else n


def _place(full: Tensor, shard: Tensor, dim: int | None, gated: bool, index: int, parts: int) -> None:
    """Write TP shard ``index`` of ``parts`` into ``full`` (a gated ``linear_fc1`` shard
    is its gate and up halves, each a chunk of the full gate and up)."""
    if dim is None:
        full.copy_(shard)
        return
    pairs = zip(full.chunk(2, 0), shard.chunk(2, 0)) if gated else [(full, shard)]
    for whole, part in pairs:
        n = whole.size(dim) // parts
        whole.narrow(dim, index * n, n).copy_(part)


class MegatronCoreAdapter(Adapter):
    """One device's share of a Megatron-Core job across plan generations."""

    name = NAME
    capabilities = CAPABILITIES

    def __init__(self, ctx: AdapterContext, job: MegatronJob | None = None) -> None:
        super().__init__(ctx)
        from resihp_adapters.torchkit.device import placement_for

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        self.placement = placement_for(ctx.device, ctx.job.adapter_config, own_transfers=False)
        self.cuda = self.placement.is_cuda
        if not torch.cuda.is_available():
            from resihp_adapters.megatron_core import cpu

            cpu.enable()
        elif self.cuda:
            torch.cuda.set_device(self.placement.device)
        self.job = job if job is not None else load_job(ctx.job.adapter_config)
        check_supported(self.job, cuda=self.cuda)
        self.seed = int(ctx.job.seed)
        self.global_mbs = ctx.job.dp * ctx.job.num_microbatches  # micro-batches per iteration, any plan
        self.plan: ParallelPlan | None = None  # the plan this device's state is laid out for
        self._next: ParallelPlan | None = None  # the plan being entered
        self.model: Any = None  # this stage's GPTModel
        self.ddp: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._held: Held = {}  # the state by global name while no model holds it
        self.steps = 0  # optimizer steps applied (Adam's step count)
        self.sched_steps = 0  # the scheduler's position (samples)
        self._snap: tuple[dict[str, list[Tensor]], int, int] | None = None
        self._ckpt_status: list[CheckpointWrite] = []  # finished checkpoint writes, not yet reported
        self._flags: tuple[bool, bool] | None = None  # (tied output layer, learned positions)
        self._pending: tuple[ParallelPlan, ParallelPlan, list[int]] | None = None  # checked move
        self._staged: dict[str, list[Tensor]] | None = None  # full tensors moved before the rebuild
        self._premoved_bytes = 0
        self._published: set[str] = set()
        self._meta_cache: dict[str, dict[str, list[Any]]] = {}
        self.dist_opt = bool(self.job.optimizer.get("use_distributed_optimizer")
                             or self.job.ddp.get("use_distributed_optimizer"))
        # With the distributed optimizer: every parameter's whole Adam moments (this TP
        # shard's), gathered from the DP ranks after each step, by id of the parameter.
        self._moments: dict[int, tuple[Tensor, Tensor]] = {}

    # ------------------------------------------------------------------ where
    @property
    def where(self) -> tuple[int, int, int] | None:
        return self.plan.location(self.ctx.device) if self.plan is not None else None

    # ------------------------------------------------------------------ state by name
    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        opt = self.optimizer
        return [c.optimizer for c in getattr(opt, "chained_optimizers", [opt])]

    def _adam_state(self) -> dict[int, dict[str, Any]]:
        """Adam's moments by id of the model parameter, whole (the distributed
        optimizer's shards gathered by :meth:`_gather_moments`)."""
        if self.dist_opt:
            return {k: {"exp_avg": m, "exp_avg_sq": v} for k, (m, v) in self._moments.items()}
        out: dict[int, dict[str, Any]] = {}
        for o in self._torch_optimizers():
            for group in o.param_groups:
                for p in group["params"]:
                    out[id(p)] = o.state[p]
        return out

    def _live_entries(self, *, skip_tied_copy: bool = False) -> Held:
        """Every parameter of the live model by global name, with its Adam moments
        (zeros, not installed, before the first step)."""
        plan, model = self._next or self.plan, self.model
        r, s, t = plan.location(self.ctx.device)
        first = plan.layer_ranges[s][0]
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
        pre = bool(getattr(model, "pre_process", s == 0))
        gated = bool(getattr(model.config, "gated_linear_unit", False))
        adam = self._adam_state()
        out: Held = {}
        for local, p in model.named_parameters():
            name = st.canonical(local, first, pre, tied)
            if skip_tied_copy and name != local and name == "embedding.word_embeddings.weight":
                continue
            dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
            state = adam.get(id(p), {})
            m = state.get("exp_avg")
            v = state.get("exp_avg_sq")
            out[name] = st.Entry([p.data, m if m is not None else torch.zeros_like(p.data),
                                  v if v is not None else torch.zeros_like(p.data)], dim, t, plan.degree(r, s),
                                 gated=gated and name.endswith("mlp.linear_fc1.weight")
                                 or gated and name.endswith("mlp.linear_fc1.bias"))
        return out

    def _shards(self) -> Iterator[tuple[torch.optim.Optimizer, Tensor, Tensor, int, int]]:
        """Every main-parameter shard the distributed optimizer updates on this DP rank:
        (its torch optimizer, the model parameter, the shard, the shard's range in the
        flattened parameter). Float32 parameters only (the spec refuses others), so the
        shard is a view of the model parameter."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for d in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if not isinstance(d, DistributedOptimizer):
                continue
            for model_group, shard_group in zip(d.model_fp32_groups, d.shard_fp32_groups):
                for mp, sp in zip(model_group, shard_group):
                    r = d._get_model_param_range_map(mp)["param"]
                    yield d.optimizer, mp, sp, r.start, r.end

    def _gather_moments(self) -> None:
        """After a step of the distributed optimizer: each DP rank's Adam shards summed
        into whole moments (zeros elsewhere, so the sum is exact) on every DP rank of the
        stage, so that any one survivor holds the whole state of its TP shard."""
        from megatron.core import parallel_state as ps

        params = [p for _, p in self.model.named_parameters()]
        offsets, total = {}, 0
        for p in params:
            offsets[id(p)] = total
            total += p.numel()
        ref = params[0].data
        buf = torch.zeros(2 * total, dtype=ref.dtype, device=ref.device)
        for opt, mp, sp, a, b in self._shards():
            state = opt.state.get(sp, {})
            if "exp_avg" not in state:
                continue
            at = offsets[id(mp)]
            buf[at + a:at + b].copy_(state["exp_avg"].reshape(-1))
            buf[total + at + a:total + at + b].copy_(state["exp_avg_sq"].reshape(-1))
        dist.all_reduce(buf, group=ps.get_data_parallel_group(with_context_parallel=True))
        self._moments = {id(p): (buf[offsets[id(p)]:offsets[id(p)] + p.numel()].view_as(p.data),
                                 buf[total + offsets[id(p)]:total + offsets[id(p)] + p.numel()].view_as(p.data))
                         for p in params}

    def _install(self, entries: Held) -> None:
        """Put ``entries`` (already written in place) into the optimizer's state with the
        job's step count, and the scheduler at its position. The distributed optimizer
        gets each DP rank's range of the whole moments."""
        if self.dist_opt:
            self._moments = {k: (e.tensors[1], e.tensors[2]) for k, e in self._entry_of_param.items()}
            if self.steps > 0:
                for opt, mp, sp, a, b in self._shards():
                    m, v = self._moments[id(mp)]
                    opt.state[sp] = {"step": torch.tensor(float(self.steps)), "exp_avg": m.reshape(-1)[a:b].clone(),
                                     "exp_avg_sq": v.reshape(-1)[a:b].clone()}
        elif self.steps > 0:
            for o in self._torch_optimizers():
                for group in o.param_groups:
                    for p in group["params"]:
                        e = self._entry_of_param.get(id(p))
                        if e is None:
                            continue
                        o.state[p] = {"step": torch.tensor(float(self.steps)), "exp_avg": e.tensors[1],
                                      "exp_avg_sq": e.tensors[2]}
        if self.scheduler is not None:
            self.scheduler.num_steps = self.sched_steps
            self.scheduler.step(increment=0)

    def _entries_with_ids(self) -> Held:
        """:meth:`_live_entries`, remembering which parameter each entry is."""
        entries = self._live_entries()
        plan = self._next or self.plan
        r, s, t = plan.location(self.ctx.device)
        first = plan.layer_ranges[s][0]
        tied = bool(getattr(self.model, "share_embeddings_and_output_weights", False))
        pre = bool(getattr(self.model, "pre_process", s == 0))
        self._entry_of_param = {id(p): entries[st.canonical(local, first, pre, tied)]
                                for local, p in self.model.named_parameters()}
        return entries

    def _state(self) -> Held:
        """The state this device holds now, by global name."""
        if self.model is not None and self._next is None:
            return self._live_entries()
        return self._held

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> None:
        self._snap = ({k: [t.clone() for t in e.tensors] for k, e in self._state().items()}, self.steps,
                      self.sched_steps)

    def rollback(self) -> None:
        if self._snap is None:
            return
        saved, self.steps, self.sched_steps = self._snap
        if self.model is not None and self._next is None:
            entries = self._entries_with_ids()
            with torch.no_grad():
                for k, e in entries.items():
                    for dst, src in zip(e.tensors, saved[k]):
                        dst.copy_(src)
            for o in self._torch_optimizers():
                o.state.clear()
            self._install(entries)
            self.ddp.zero_grad_buffer()
        else:
            for k, e in self._held.items():
                e.tensors = [t.clone() for t in saved[k]]

    # ------------------------------------------------------------------ communicators
    def _drop_model(self) -> None:
        """Keep the state by name, drop every object that holds a process group."""
        if self.model is not None and self._next is None:
            self._held = self._live_entries()
        # Megatron's DDP registers gradient hooks whose closures hold the wrapper: a cycle
        # through C++ hooks that Python's collector cannot see, which would keep every
        # group the model, DDP and optimizer hold (and their sockets) alive. Emptying the
        # objects leaves the hooks holding empty shells.
        for obj in (self.ddp, *getattr(self.optimizer, "chained_optimizers", ()), self.optimizer, self.scheduler):
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                d.clear()
        self.model = self.ddp = self.optimizer = self.scheduler = None
        self._entry_of_param = {}
        self._moments = {}

    def release(self) -> None:
        from megatron.core import parallel_state as ps

        from resihp_adapters.torchkit.device import release_world

        self._drop_model()
        self._next = None
        ps.destroy_model_parallel()
        release_world(self.placement)
        gc.collect()

    def rebuild_communicators(self, plan: ParallelPlan, generation: int, devices: list[int]) -> None:
        from megatron.core import parallel_state as ps

        from resihp_core.runtime.session import rendezvous_store

        self.release()
        pending, self._pending, self._staged = self._pending, None, None
        if pending is not None and pending[1] is plan:
            self._staged = self._premove(*pending, generation)
        where = plan.location(self.ctx.device)
        if where is None:
            self._next = plan
            return  # a standby: no place in Megatron's world this generation
        tp = _uniform_tp(plan)
        live = live_replicas(plan)
        world = tp * plan.pp * len(live)
        rank = megatron_rank(plan, self.ctx.device)
        join = timedelta(seconds=6.0 * self.ctx.timeout_s + 10.0)
        dist.init_process_group(self.placement.init_backend, store=rendezvous_store(self.ctx.store, generation),
                                rank=rank, world_size=world, timeout=join)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=plan.pp,
                                     distributed_timeout_minutes=self.ctx.timeout_s / 60.0)
        got = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())
        want = (where[2], where[1], live.index(where[0]))
        if got != want:
            raise RuntimeError(f"Megatron placed device {self.ctx.device} at (tp, pp, dp) {got}, the plan at {want}")
        self._next = plan
        self._build(plan)

    def _premove(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int], generation: int
                 ) -> dict[str, list[Tensor]] | None:
        """When some shard's source is a device that leaves Megatron's world (a standby of
        the new plan, e.g. the departing member of a shrunk TP group), move the state
        first in a world of every device (store prefix ``gen{g}/move/``): each receiver
        gets the whole old shards it overlaps and lays them into full-size tensors
        (shapes from the layout-independent metadata every builder publishes), which
        :meth:`move_state` slices into the new shards. None: every source stays, the move
        runs in Megatron's world."""
        from resihp_core.runtime.session import rendezvous_store

        from resihp_adapters.torchkit.device import release_world
        from resihp_adapters.torchkit.transfer import transfer_plan

        plan = transfer_plan(old_plan, new_plan, devices, self._components())
        executors = set(new_plan.devices())
        if not any(tr.src not in executors for tr in plan if tr.src != tr.dst):
            return None
        me = self.ctx.device
        ranks = {d: i for i, d in enumerate(devices)}
        join = timedelta(seconds=6.0 * self.ctx.timeout_s + 10.0)
        dist.init_process_group(self.placement.init_backend,
                                store=dist.PrefixStore("move/", rendezvous_store(self.ctx.store, generation)),
                                rank=ranks[me], world_size=len(devices), timeout=join)
        try:
            staged: dict[str, list[Tensor]] = {}
            works, recvd = [], []
            for i, tr in enumerate(plan):
                if me not in (tr.src, tr.dst):
                    continue
                meta = self._meta(tr.component)
                names = sorted(meta)
                if tr.src == me:
                    payload = torch.cat([self._held[n].tensors[f].reshape(-1) for n in names
                                         for f in range(len(st.FIELDS))])
                    if tr.dst == me:
                        recvd.append((tr, names, payload))
                    else:
                        works.append(dist.isend(payload.contiguous(), ranks[tr.dst], tag=i))
                else:
                    numel = sum(_shard_numel(meta[n], tr.src_deg) for n in names) * len(st.FIELDS)
                    buf = torch.empty(numel, dtype=_dtype(meta[names[0]]))
                    works.append(dist.irecv(buf, ranks[tr.src], tag=i))
                    recvd.append((tr, names, buf))
            for w in works:
                w.wait()
            self._premoved_bytes = 0
            for tr, names, buf in recvd:
                at = 0
                for n in names:
                    shape, dim, gated, _ = meta_of = self._meta(tr.component)[n]
                    fulls = staged.setdefault(n, [torch.zeros(shape, dtype=_dtype(meta_of))
                                                  for _ in st.FIELDS])
                    k = _shard_numel(meta_of, tr.src_deg)
                    local = list(shape)
                    if dim is not None:
                        local[dim] //= tr.src_deg
                    for f in range(len(st.FIELDS)):
                        _place(fulls[f], buf[at:at + k].view(local), dim, gated, tr.src_tp, tr.src_deg)
                        at += k
                if tr.src != me:
                    self._premoved_bytes += buf.numel() * buf.element_size()
        finally:
            release_world(self.placement)
        return staged

    _META_KEY = "megatron_core/meta/"

    def _publish_meta(self) -> None:
        """Layout-independent shapes of this stage's parameters (full shape, TP dim,
        gated, dtype) in the job store, per component, once per process."""
        import json

        by_comp: dict[str, dict[str, list[Any]]] = {}
        for name, e in self._live_entries().items():
            shape = list(e.tensors[0].shape)
            if e.dim is not None:
                shape[e.dim] *= e.size
            by_comp.setdefault(st.component_of(name), {})[name] = [shape, e.dim, e.gated, str(e.tensors[0].dtype)]
        for comp, d in by_comp.items():
            if comp not in self._published:
                self.ctx.store.set(self._META_KEY + comp, json.dumps(d))
                self._published.add(comp)

    def _meta(self, comp: str) -> dict[str, list[Any]]:
        import json

        if comp not in self._meta_cache:
            self._meta_cache[comp] = json.loads(self.ctx.store.get(self._META_KEY + comp).decode())
        return self._meta_cache[comp]

    def _build(self, plan: ParallelPlan) -> None:
        """This stage's model, DDP wrapper, optimizer and scheduler (:mod:`.build`), with
        the seeded initial weights (the same on every rank holding them)."""
        config = transformer_config(self.job, tp=_uniform_tp(plan), pp=plan.pp, layer_ranges=plan.layer_ranges,
                                    cuda=self.cuda)
        tr = build_training(self.job, config, seed=self.seed, device=self.placement.device if self.cuda else None)
        self.model, self.ddp, self.optimizer, self.scheduler = tr.model, tr.ddp, tr.optimizer, tr.scheduler
        if self._flags is None:
            self._flags = (bool(getattr(tr.model, "share_embeddings_and_output_weights", False)),
                           getattr(tr.model, "position_embedding_type", "learned_absolute") == "learned_absolute")
            self.ctx.store.set(self._FLAGS_KEY, "".join(str(int(f)) for f in self._flags))
        self._publish_meta()

    def _enter(self, plan: ParallelPlan) -> None:
        """The new model holds the job's state: it is the plan's now."""
        self.plan, self._next = plan, None
        self._held = {}

    # ------------------------------------------------------------------ state
    def start_fresh(self, plan: ParallelPlan) -> None:
        self.steps = self.sched_steps = 0
        self._enter(plan)

    _FLAGS_KEY = "megatron_core/model_flags"

    def _components(self) -> Callable[[ParallelPlan, int], list[str]]:
        """``(plan, stage) -> components`` of the user's model: whether its output layer is
        tied to the word embedding and whether it has learned position embeddings, read
        from the first model built (a device that has built none reads what a builder
        published in the job store)."""
        if self._flags is None:
            raw = self.ctx.store.get(self._FLAGS_KEY)
            self._flags = tuple(bool(int(c)) for c in raw.decode())
        return st.components_of_stage(*self._flags)

    def _alive(self, new_plan: ParallelPlan, devices: list[int]) -> list[int]:
        return sorted(set(new_plan.devices()) & set(devices))

    def check_move(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> None:
        """Raise ``StateLost`` unless every shard of ``new_plan`` has a complete surviving
        copy on ``devices`` (standbys included); remember the move for the rebuild."""
        from resihp_adapters.torchkit.transfer import transfer_plan

        self._pending = None
        transfer_plan(old_plan, new_plan, sorted(devices), self._components())
        self._pending = (old_plan, new_plan, sorted(devices))

    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> int:
        """Fill the new model's parameters, Adam moments and scheduler position from the
        survivors (this device's own copy where it already holds the right shard); on
        failure the previous state stays as it was (``_held``)."""
        from resihp_adapters.torchkit.transfer import transfer_plan

        staged, self._staged = self._staged, None
        if staged is not None:
            return self._move_staged(staged, new_plan)
        plan = transfer_plan(old_plan, new_plan, self._alive(new_plan, devices), self._components())
        me = self.ctx.device
        old = self._held
        if self.model is None:  # a standby in the new plan: it keeps nothing
            if any(tr.src == me for tr in plan):
                raise RuntimeError(f"device {me} is a standby but the move sources from it")
            self.plan, self._next, self._held = new_plan, None, {}
            return 0
        new = self._entries_with_ids()
        by_comp: dict[str, list[str]] = {}
        for name in new:
            by_comp.setdefault(st.component_of(name), []).append(name)
        old_by_comp: dict[str, list[str]] = {}
        for name in old:
            old_by_comp.setdefault(st.component_of(name), []).append(name)
        moved = {(tr.component, tr.dst) for tr in plan}
        with torch.no_grad():
            for name, e in new.items():
                if (st.component_of(name), me) not in moved:
                    for dst, src in zip(e.tensors, old[name].tensors):
                        dst.copy_(src)
        rank_of = {d: megatron_rank(new_plan, d) for d in new_plan.devices()}
        works, recvd, nbytes = [], [], 0
        for i, tr in enumerate(plan):
            if me not in (tr.src, tr.dst):
                continue
            names = sorted(by_comp.get(tr.component, []) if tr.dst == me else old_by_comp.get(tr.component, []))
            if tr.src == me:
                parts = []
                for name in names:
                    e_src = old[name]
                    for piece, so, _, n in self._segments(e_src, tr, src_side=True):
                        for f in range(len(st.FIELDS)):
                            parts.append(st.take(e_src, f, piece, so, n).reshape(-1))
                payload = torch.cat(parts) if parts else torch.zeros(0)
                if tr.dst == me:
                    recvd.append((tr, names, payload))
                else:
                    works.append(dist.isend(payload.contiguous(), rank_of[tr.dst], tag=i))
            else:
                numel = 0
                for name in names:
                    for piece, _, do, n in self._segments(new[name], tr, src_side=False):
                        numel += st.take(new[name], 0, piece, do, n).numel() * len(st.FIELDS)
                buf = torch.empty(numel, dtype=next(iter(new.values())).tensors[0].dtype,
                                  device=next(iter(new.values())).tensors[0].device)
                works.append(dist.irecv(buf, rank_of[tr.src], tag=i))
                recvd.append((tr, names, buf))
        for w in works:
            w.wait()
        with torch.no_grad():
            for tr, names, buf in recvd:
                at = 0
                for name in names:
                    e = new[name]
                    for piece, _, do, n in self._segments(e, tr, src_side=False):
                        for f in range(len(st.FIELDS)):
                            dst = st.take(e, f, piece, do, n)
                            dst.copy_(buf[at:at + dst.numel()].view_as(dst))
                            at += dst.numel()
                if at != buf.numel():
                    raise RuntimeError(f"move of {tr.component} from device {tr.src}: {buf.numel()} values "
                                       f"received, {at} expected (the two layouts disagree)")
                if tr.src != me:
                    nbytes += buf.numel() * buf.element_size()
        self._install(new)
        self._enter(new_plan)
        return nbytes

    def _move_staged(self, staged: dict[str, list[Tensor]], new_plan: ParallelPlan) -> int:
        """Fill the new model from what :meth:`_premove` moved (full-size tensors, of
        which this device's new shards are filled) and from the shards it kept."""
        if self.model is not None:
            new = self._entries_with_ids()
            with torch.no_grad():
                for name, e in new.items():
                    if name not in staged:
                        for dst, src in zip(e.tensors, self._held[name].tensors):
                            dst.copy_(src)
                        continue
                    for f, full in enumerate(staged[name]):
                        if e.dim is None:
                            e.tensors[f].copy_(full)
                            continue
                        for piece, whole in zip(st.pieces(e.tensors[f], e), st.pieces(full, e)):
                            piece.copy_(whole.chunk(e.size, e.dim)[e.rank])
            self._install(new)
            self._enter(new_plan)
        else:
            self.plan, self._next, self._held = new_plan, None, {}
        return self._premoved_bytes

    @staticmethod
    def _segments(e: st.Entry, tr: Transfer, *, src_side: bool) -> list[tuple[int, int, int, int]]:
        """(piece, source offset, destination offset, length) of a transfer for one
        entry; offsets -1: the whole (replicated) tensor."""
        if e.dim is None:
            return [(0, -1, -1, -1)] if tr.src_tp == tr.dst_tp * tr.src_deg // tr.dst_deg else []
        out = []
        k_here = tr.src_deg if src_side else tr.dst_deg
        for p, piece in enumerate(st.pieces(e.tensors[0], e)):
            full = piece.size(e.dim) * k_here
            o = st.overlap(full, tr.src_tp, tr.src_deg, tr.dst_tp, tr.dst_deg)
            if o is not None:
                out.append((p, *o))
        return out

    # ------------------------------------------------------------------ execution
    def _batches(self, iteration: int, mbs: list[tuple[int, int]]) -> Iterator[Any]:
        """The collated micro-batches of ``mbs`` (plan (owner, mb)) in order: global
        micro-batch ``g = owner * m + mb`` (:func:`.build.samples_of`)."""
        m = self.plan.num_microbatches
        for owner, mb in mbs:
            yield samples_of(self.job, iteration, owner * m + mb, self.global_mbs)

    def run_iteration(self, program: Program, iteration: int) -> IterationResult:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        _, s, _ = self.where
        mbs = [(op.owner, op.mb) for op in program.ops if isinstance(op, Forward)]
        res = IterationResult(iteration)
        scale = len(mbs) * len(live_replicas(self.plan)) / self.global_mbs
        losses: list[float] = []
        counter = iter(range(1 << 30))
        user_step = self.job.forward_step
        t_iter = time.perf_counter()

        def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module) -> tuple[Tensor, Any]:
            k = next(counter)
            self.ctx.step(iteration, k)
            t0 = time.perf_counter()
            output, loss_func = user_step(data_iterator, model)
            owner, mb = mbs[k]
            res.forward_s[(owner, mb)] = self.ctx.faults.stretch(time.perf_counter() - t0)
            res.computed.append((s, owner, mb))

            def scaled(out: Tensor) -> tuple:
                got = loss_func(out)
                if len(got) == 3:
                    total, tokens, rep = got
                    losses.append(float(total.detach()) / max(float(tokens), 1.0))
                    return total * scale, tokens, rep
                loss, rep = got
                losses.append(float(loss.detach()))
                return loss * scale, rep

            return output, scaled

        self.ctx.step(iteration, 0)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=self._batches(iteration, mbs),
                                    model=[self.ddp], num_microbatches=len(mbs), seq_length=self.job.seq_length,
                                    micro_batch_size=self.job.micro_batch_size, forward_only=False)
        self.ctx.step(iteration, len(mbs) + 1)
        self.optimizer.step()
        if self.dist_opt:
            self._gather_moments()
        self.steps = iteration + 1
        if self.scheduler is not None:
            self.sched_steps += self.global_mbs * self.job.micro_batch_size
            self.scheduler.step(increment=self.global_mbs * self.job.micro_batch_size)
        res.loss = sum(losses) / self.global_mbs
        res.iteration_s = time.perf_counter() - t_iter
        return res

    # ------------------------------------------------------------------ reports
    def held_state(self) -> dict[str, Shard]:
        """Every parameter with its Adam moments, TP shards as :class:`Shard` pieces (a
        gated ``linear_fc1`` as its ``.gate`` and ``.up`` halves, each a plain TP shard);
        a last stage's copy of the tied embedding is left to the first stage's."""
        entries = self._live_entries(skip_tied_copy=True) if self.model is not None and self._next is None \
            else self._held
        out = {}
        for name, e in entries.items():
            for p, suffix in enumerate((".gate", ".up") if e.gated else ("",)):
                ts = tuple(st.pieces(t, e)[p].detach().clone() for t in e.tensors)
                out[name + suffix] = Shard(ts) if e.dim is None else Shard(ts, e.dim, e.rank, e.size)
        return out

    def full_state(self) -> dict[str, Any]:
        """Megatron's training state by layout-independent name: every parameter
        (``model.<name>``, TP shards as :class:`Shard`), Adam's moments
        (``optimizer.<name>.exp_avg[_sq]``) and step count, the learning rate and weight
        decay the scheduler set, its position, and the data position. No random numbers
        are drawn while training (dropout is refused on CPU), so there is no RNG state."""
        out: dict[str, Any] = {}
        for name, sh in self.held_state().items():
            for key, t in zip((f"model.{name}", f"optimizer.{name}.exp_avg", f"optimizer.{name}.exp_avg_sq"),
                              sh.tensors):
                out[key] = Shard((t,), sh.dim, sh.index, sh.parts) if sh.dim is not None else t
        out["optimizer.step"] = self.steps
        out["scheduler.num_steps"] = self.sched_steps
        out["data.iteration"] = self.steps
        if self.optimizer is not None:
            groups = self.optimizer.param_groups
            out["optimizer.lr"] = sorted({float(g["lr"]) for g in groups})
            out["optimizer.weight_decay"] = sorted({float(g["weight_decay"]) for g in groups})
        return out

    # ------------------------------------------------------------------ checkpoints
    def _moments_by_param(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Adam's whole moments of every live parameter, by id (zeros before a step)."""
        self._entries_with_ids()
        return {k: (e.tensors[1], e.tensors[2]) for k, e in self._entry_of_param.items()}

    def _common(self, iteration: int) -> dict[str, Any]:
        """The checkpoint's common part: positions, and the scheduler's own state."""
        out: dict[str, Any] = {"resihp": {"iteration": iteration, "optimizer_step": self.steps,
                                          "scheduler_num_steps": self.sched_steps, "data_iteration": self.steps}}
        if self.scheduler is not None:
            out["opt_param_scheduler"] = self.scheduler.state_dict()
        return out

    def save_checkpoint(self, iteration: int) -> None:
        """Every executor writes its part of one ``dist_checkpointing`` checkpoint
        (:mod:`.checkpoint`; only main replicas' shards are written) into the iteration's
        folder; then rank 0 seals it (the contract's manifest) and prunes. A storage
        error is reported through :meth:`checkpoint_status`, not raised; a dead peer
        raises."""
        from torch.distributed.checkpoint import CheckpointException

        from megatron.core.dist_checkpointing.core import CheckpointingException

        from resihp_core import checkpoints
        from resihp_adapters.megatron_core import checkpoint as mc

        if self.model is None or self._next is not None:
            return  # a standby: not in Megatron's world
        t0 = time.perf_counter()
        root = self.ctx.job.checkpoint_dir
        folder = checkpoints.iteration_dir(root, iteration)
        error = None
        if dist.get_rank() == 0:
            try:  # an older, unsealed or superseded attempt at this iteration
                if folder.exists():
                    import shutil

                    shutil.rmtree(folder)
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        dev = self.placement.device if self.cuda else None  # NCCL reduces device tensors only
        failed = torch.tensor([0 if error is None else 1], device=dev)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if int(failed) == 0:
            try:
                mc.save(folder, self.model, self._moments_by_param(), self._common(iteration))
            except (OSError, CheckpointException, CheckpointingException) as e:
                error = f"{type(e).__name__}: {e}"
            failed = torch.tensor([0 if error is None else 1], device=dev)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # the verdict, and a barrier
        nbytes = 0
        if dist.get_rank() == 0:
            if error is None and int(failed) == 0:
                try:
                    nbytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                    checkpoints.seal(root, iteration)
                    pruned = tuple(checkpoints.prune(root, self.ctx.job.checkpoint_keep))
                    self._ckpt_status.append(CheckpointWrite(iteration, None, nbytes, time.perf_counter() - t0,
                                                             pruned))
                except (OSError, ValueError) as e:
                    error = f"{type(e).__name__}: {e}"
            elif error is None:
                error = "another writer of this checkpoint failed; it is left unsealed (incomplete)"
        if error is not None:
            self._ckpt_status.append(CheckpointWrite(iteration, error, 0, time.perf_counter() - t0))

    def checkpoint_status(self) -> list[CheckpointWrite]:
        out, self._ckpt_status = self._ckpt_status, []
        return out

    def load_checkpoint(self, iteration: int, plan: ParallelPlan) -> None:
        """This device's shards of ``plan`` from the ``dist_checkpointing`` checkpoint
        ``iteration`` (written at any layout; Megatron's load reshards)."""
        from resihp_core import checkpoints
        from resihp_adapters.megatron_core import checkpoint as mc

        folder = checkpoints.iteration_dir(self.ctx.job.checkpoint_dir, iteration)
        pos = mc.load_common(folder)["resihp"]
        self.steps, self.sched_steps = int(pos["optimizer_step"]), int(pos["scheduler_num_steps"])
        if self.model is None:
            self.plan, self._next, self._held = plan, None, {}
            return
        new = self._entries_with_ids()
        mc.load(folder, self.model, {k: (e.tensors[1], e.tensors[2]) for k, e in self._entry_of_param.items()})
        self._install(new)
        self._enter(plan)

    def close(self) -> None:
        self.release()
