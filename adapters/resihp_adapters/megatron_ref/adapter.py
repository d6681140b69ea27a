"""The reference Megatron-style adapter: one instance per worker process.

It holds this device's stage (a :class:`StageModule` shard) and AdamW state, runs
per-executor programs (GPipe / 1F1B / ZB-H1 / migrated work) with heterogeneous-TP
P2P and exact DP reduction, and reconfigures live: new communicators for a plan
generation, parameters and optimizer state moved or re-sharded component by
component, checkpoints written and restored.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from resihp_core.adapter import Adapter, AdapterContext, Capabilities, IterationResult, Shard
from resihp_core.detector import sdc
from resihp_core.detector.sdc import Fingerprint, tensor_digest
from resihp_core.plan import ParallelPlan
from resihp_core.protocols.checkpoints import CheckpointWrite
from resihp_core.runtime.peercopy import MemoryCopy, MemoryPiece
from resihp_core.program import (
    Backward,
    BackwardWeight,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    Program,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)
from resihp_core.protocol import IterationProfile, MicroBatchProfile
from resihp_adapters.megatron_ref import state
from resihp_adapters.torchkit import comm
from resihp_adapters.torchkit.checkpoint import CheckpointWriter
from resihp_adapters.torchkit.device import AbortWatch, ChunkTimer, placement_for
from resihp_adapters.megatron_ref.data import DataSpec, label_count, lengths_of, micro_batch
from resihp_adapters.megatron_ref.model import ModelConfig, StageModule, TPContext, shard_dim
from resihp_adapters.megatron_ref.plugin import CAPABILITIES, NAME

__all__ = ["MegatronRefAdapter", "model_config", "data_spec"]

Tensors3 = tuple[Tensor, Tensor, Tensor]  # parameter, exp_avg, exp_avg_sq

#: Under NCCL, how long a superseded worker has to reach the next generation before its
#: communicators are aborted: an idle one gets there in milliseconds and keeps its world
#: to derive the next one from; one blocked in a collective is released after this.
ABORT_GRACE_S = 0.5


def model_config(job) -> ModelConfig:
    """The model of this adapter's job section (``lr`` is the optimizer's)."""
    section = {k: v for k, v in job.adapter_config.items() if k not in ("lr", "backend", "devices_per_node")}
    try:
        return ModelConfig(**section)
    except TypeError as e:
        raise ValueError(f"job.adapter_config for megatron_ref: {e}") from None


def data_spec(job) -> DataSpec:
    """The job's data source (``job.data``: a ``[data]`` section, resolved by the
    controller), built once per process (:func:`resihp_core.data.create_source`)."""
    from dataclasses import asdict, fields

    from resihp_core.data import create_source
    from resihp_core.predictor.corpus import CorpusSpec

    section = dict(job.data)
    options = {k: v for k, v in section.items() if k != "source"}
    if section.get("source", "synthetic") == "synthetic" and set(options) <= {f.name for f in fields(CorpusSpec)}:
        # A hand-written synthetic section keeps CorpusSpec's own defaults, as before
        # data sources existed (the controller always writes every field).
        section = {"source": "synthetic", **asdict(CorpusSpec(**options))}
    return DataSpec(create_source(section, dp=job.dp, num_microbatches=job.num_microbatches, seed=job.seed,
                                  vocab_size=model_config(job).vocab_size))


class MegatronRefAdapter(Adapter):
    """Worker-side execution of ResiHP plans on the pure-torch reference model."""

    name = NAME
    capabilities: Capabilities = CAPABILITIES

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        torch.set_num_threads(1)
        self.device = ctx.device
        self.config = model_config(ctx.job)
        # Every transfer of this backend is its own (torchkit.comm), so workers sharing
        # one GPU compute on it and stage transfers through the host (docs/gpu.md).
        self.placement = placement_for(ctx.device, ctx.job.adapter_config, own_transfers=True)
        self._watch: AbortWatch | None = None
        self.data = data_spec(ctx.job)
        self.store = ctx.store
        self.timeout_s = ctx.timeout_s
        self.checkpoint_dir = ctx.job.checkpoint_dir
        self.optimizer = state.AdamW(lr=float(ctx.job.adapter_config.get("lr", 1e-3)))
        self.plan: ParallelPlan | None = None
        self.devices: list[int] = []
        self.comms: comm.Communicators | None = None
        self.module: StageModule | None = None
        self._where: tuple[int, int, int] | None = None  # (replica, stage, tp rank)
        self._snapshot: dict[str, Tensors3] | None = None
        self._last: IterationResult | None = None
        self._ckpt_writer: CheckpointWriter | None = None
        self.steps = 0  # optimizer updates the held state has had (AdamW's step count)
        self._watch_grads = sdc.enabled(True)
        # the share of each parameter tensor a fingerprint reads, and in how many steps it
        # reads all of the AdamW moments
        self._coverage, self._rounds = sdc.windows()
        self._grad_norm: float | None = None
        self._snapshot_steps = 0

    @property
    def where(self) -> tuple[int, int, int] | None:
        return self._where

    # ------------------------------------------------------------- state access
    def _params(self) -> dict[str, Tensor]:
        return dict(self.module.named_parameters()) if self.module is not None else {}

    def held_state(self) -> dict[str, Shard]:
        tp = self.module.tp if self.module is not None else None
        return {name: Shard(tuple(ts), shard_dim(name), tp.rank, tp.size) if shard_dim(name) is not None
                else Shard(tuple(ts))
                for name, ts in self.tensors().items()}

    def tensors(self) -> dict[str, Tensors3]:
        """Parameter and AdamW tensors of every shard this worker holds, by global name."""
        out = {}
        for name, p in self._params().items():
            m, v = self.optimizer.ensure(name, p)
            out[name] = (p.data, m, v)
        return out

    def fingerprint(self) -> Fingerprint | None:
        """Checksum of every parameter this device holds and of this step's window of
        its AdamW moments; the group is the stage's layer range with this TP rank and
        degree: every replica holding it has the same bits after the
        (replica-identical) all-reduce and step."""
        if self.module is None or self._where is None:
            return None
        r, s, t = self._where
        k = self.plan.degree(r, s)
        if sdc.same_layout_replicas(self.plan, r, s) < 2:
            return None  # no replica holds this shard: nothing to compare (the range signals still run)
        a, b = self.plan.layer_ranges[s]
        held = sorted(self.tensors().items())
        params = [(f"p.{name}", ts[0]) for name, ts in held]
        moments = [(f"{kind}.{name}", x) for name, ts in held for kind, x in zip(("m", "v"), ts[1:])]
        return Fingerprint(f"stage{s}/layers{a}-{b}/tp{t}of{k}/step{self.steps}",
                           tensor_digest(params, share=self._coverage, turn=self.steps, state=moments,
                                         rounds=self._rounds))

    def sdc_signals(self) -> dict[str, float]:
        """The L2 norm of this device's reduced gradient shards at its last step."""
        return {} if self._grad_norm is None else {"grad_norm": self._grad_norm}

    def full_state(self) -> dict[str, Any]:
        """Everything this framework's training state is, by layout-independent name:
        each parameter (``model.<name>``) and its AdamW moments
        (``optimizer.<name>.exp_avg`` / ``.exp_avg_sq``), TP-sharded ones as
        :class:`Shard` pieces the kit assembles; AdamW's step count and learning rate
        (constant: no scheduler); the data position (the next iteration's micro-batches
        are a function of it). No random numbers are drawn while training (weights are
        seeded per name), so there is no RNG state."""
        tp = self.module.tp if self.module is not None else None
        out: dict[str, Any] = {}
        for name, ts in self.tensors().items():
            d = shard_dim(name)
            for key, t in zip((f"model.{name}", f"optimizer.{name}.exp_avg", f"optimizer.{name}.exp_avg_sq"), ts):
                out[key] = Shard((t.detach().clone(),), d, tp.rank, tp.size) if d is not None else t.detach().clone()
        out["optimizer.step"] = self.steps
        out["optimizer.lr"] = self.optimizer.lr
        out["optimizer.betas"] = tuple(self.optimizer.betas)
        out["optimizer.weight_decay"] = self.optimizer.weight_decay
        out["data.iteration"] = self.steps
        return out

    def snapshot(self) -> None:
        """Remember the state at the start of an iteration, for rollback."""
        self._snapshot = {k: tuple(t.clone() for t in v) for k, v in self.tensors().items()}
        self._snapshot_steps = self.steps

    def rollback(self) -> None:
        """Return to the last snapshot (an iteration that was not committed everywhere)."""
        if self._snapshot is None:
            return
        self.steps = self._snapshot_steps
        with torch.no_grad():
            for name, (p, m, v) in self.tensors().items():
                sp, sm, sv = self._snapshot[name]
                p.copy_(sp), m.copy_(sm), v.copy_(sv)
        for p in self._params().values():
            p.grad = None

    # ------------------------------------------------------------- reconfiguration
    def rebuild_communicators(self, plan: ParallelPlan, generation: int, devices: list[int]) -> None:
        """The world is derived from the live one where every member holds it and the
        backend can (kept, split, shrunk), else rebuilt (torchkit.regroup)."""
        aborted = self._watch is not None and self._watch.stop()
        if self.module is not None:
            self._set_tp_group(None)  # the stage's TPContext still points at the old TP group
        previous, self.comms = (None if aborted else self.comms), None
        self._watch = None
        self.devices = sorted(devices)
        self.comms = comm.build_communicators(
            self.store, generation, self.devices, self.device, plan, self.timeout_s, placement=self.placement,
            previous=previous,
        )
        del previous
        self._watch = AbortWatch(self.placement, self.ctx.superseded, grace_s=ABORT_GRACE_S).start()

    def communicator_report(self) -> dict[str, float | str]:
        return self.comms.report() if self.comms is not None else {}

    def release(self) -> None:
        """Drop every reference to the current communicators (after a failure)."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self.comms = None
        if self.module is not None:
            self._set_tp_group(None)
        comm.release(self.placement)

    def _set_tp_group(self, group: dist.ProcessGroup | None) -> None:
        self.module.tp.group = group  # one TPContext shared by every module of the stage

    def _new_module(self, plan: ParallelPlan) -> StageModule | None:
        loc = plan.location(self.device)
        self._where = loc
        if loc is None:
            return None
        r, s, t = loc
        k = plan.degree(r, s)
        pl = self.placement
        tp = TPContext(self.comms.tp.get((r, s)), t, k, wire=pl.wire)  # shared by every module of the stage
        a, b = plan.layer_ranges[s]
        return StageModule(self.config, range(a, b), s == 0, s == plan.pp - 1, tp).to(pl.device)

    def start_fresh(self, plan: ParallelPlan) -> None:
        """Generation 0: this rank's shard of the seeded initial weights."""
        from resihp_adapters.megatron_ref.model import init_parameter

        self.plan = plan
        self.module = self._new_module(plan)
        self.optimizer.state.clear()
        self.steps = 0
        with torch.no_grad():
            for name, p in self._params().items():
                full = init_parameter(self.config, name)
                d = shard_dim(name)
                p.copy_(full if d is None else full.chunk(self.module.tp.size, d)[self.module.tp.rank])

    def check_move(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> None:
        state.transfer_plan(old_plan, new_plan, devices)  # raises NoSurvivingCopy

    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> int:
        """Re-shard/move every component to ``new_plan``'s layout; returns bytes received.
        If a transfer fails (a peer died meanwhile) the previous layout and state are
        put back, so the next generation can still source from this worker."""
        kept = (self.module, self.optimizer.state, self.plan, self._where)
        try:
            return self._move_state(old_plan, new_plan, devices)
        except BaseException:
            self.module, self.optimizer.state, self.plan, self._where = kept
            raise

    def _move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan, alive: list[int]) -> int:
        plan = state.transfer_plan(old_plan, new_plan, alive)
        old = self.tensors()
        self.module = self._new_module(new_plan)
        # Fresh AdamW tensors in the new shard shapes; every one is filled below.
        self.optimizer.state = {
            name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in self._params().items()
        }
        new = {name: (p.data, *self.optimizer.state[name]) for name, p in self._params().items()}
        # Keep shards this device already holds in exactly the needed layout.
        moved = {(tr.component, tr.dst) for tr in plan}
        with torch.no_grad():
            for name, ts in new.items():
                if (state.component_of(name), self.device) not in moved:
                    for dst, src in zip(ts, old[name]):
                        dst.copy_(src)
        works, recvd, nbytes = [], [], 0
        for i, tr in enumerate(plan):
            tag = 1_000_000 + i
            if tr.src == self.device and tr.dst == self.device:
                state.unpack(self.config, tr, state.pack(self.config, tr, old), new)
            elif tr.src == self.device:
                works.append(dist.isend(self.placement.to_wire(state.pack(self.config, tr, old)),
                                        self.comms.rank_of[tr.dst], tag=tag))
            elif tr.dst == self.device:
                buf = torch.empty(state.transfer_numel(self.config, tr), dtype=self.config.torch_dtype,
                                  device=self.placement.wire)
                works.append(dist.irecv(buf, self.comms.rank_of[tr.src], tag=tag))
                recvd.append((tr, buf))
        for w in works:
            w.wait()
        with torch.no_grad():
            for tr, buf in recvd:
                state.unpack(self.config, tr, buf, new)
                nbytes += buf.numel() * buf.element_size()
        self.plan = new_plan
        return nbytes

    # ------------------------------------------------------------- checkpoints
    def _writes_checkpoint(self) -> bool:
        if self.where is None:
            return False
        r, s, _ = self.where
        return r == min(rr for rr in range(self.plan.dp) if self.plan.group(rr, s))

    def _writer(self) -> CheckpointWriter:
        if self._ckpt_writer is None:
            self._ckpt_writer = CheckpointWriter(self.checkpoint_dir, keep=self.ctx.job.checkpoint_keep)
        return self._ckpt_writer

    def save_checkpoint(self, iteration: int) -> None:
        """Collective inside the writing TP group: the lowest replica holding each stage
        gathers full tensors (copies, so training may go on changing its own); its TP
        rank 0 hands them to the background writer, which writes one verified file per
        component and the manifest naming every component of the model."""
        if not self._writes_checkpoint():
            return
        tp = self.module.tp
        full: dict[str, dict[str, Tensors3]] = {}
        for name, ts in self.tensors().items():
            d = shard_dim(name)
            if tp.size > 1 and d is not None:
                gathered = []
                for t in ts:
                    t = self.placement.to_wire(t.contiguous())
                    parts = [torch.empty_like(t) for _ in range(tp.size)]
                    dist.all_gather(parts, t, group=tp.group)
                    gathered.append(torch.cat(parts, d))
                ts = tuple(gathered)
            else:
                ts = tuple(t.detach().clone() for t in ts)
            full.setdefault(state.component_of(name), {})[name] = ts
        if tp.rank == 0:
            every = ["embed", *(f"layers.{i}" for i in range(self.config.num_layers)), "head"]
            self._writer().submit(iteration, full, every)

    def checkpoint_status(self) -> list[CheckpointWrite]:
        if self._ckpt_writer is None:
            return []
        return [CheckpointWrite(r.iteration, r.error, r.bytes, r.seconds, tuple(r.pruned))
                for r in self._ckpt_writer.results()]

    def close(self) -> None:
        """Finish queued checkpoint writes, then end the process groups while the
        interpreter is still whole: the worker returns right after this, and a gloo group
        left to interpreter shutdown can abort the process ("terminate called without an
        active exception") after the job's last iteration (docs/torch_native.md, "Exit")."""
        if self._ckpt_writer is not None:
            self._ckpt_writer.drain()
        self.release()

    def load_checkpoint(self, iteration: int, plan: ParallelPlan) -> None:
        """Build this worker's shards of ``plan`` from checkpoint ``iteration``."""
        root = Path(self.checkpoint_dir)
        if self._ckpt_writer is not None:
            self._ckpt_writer.drain()  # our own writes of the previous generation first
        self._load_full(iteration, plan, lambda comp: state.load_component(root, iteration, comp))

    # ------------------------------------------------------------- memory copies on peers
    def _components(self) -> list[str]:
        return ["embed", *(f"layers.{i}" for i in range(self.config.num_layers)), "head"]

    def memory_copy(self) -> MemoryCopy | None:
        """The rollback snapshot's tensors (a committed iteration's state), one piece per
        component and TP rank, from the lowest replica holding each stage (the one that
        writes checkpoints; other replicas hold the same bits). No copy is made here:
        the next snapshot replaces the dict and never writes into these tensors."""
        if self._snapshot is None or self.module is None or not self._writes_checkpoint():
            return None
        tp = self.module.tp
        by_comp: dict[str, dict[str, Tensors3]] = {}
        for name, ts in self._snapshot.items():
            by_comp.setdefault(state.component_of(name), {})[name] = ts
        return MemoryCopy(tuple(MemoryPiece(c, tp.rank, tp.size, ts) for c, ts in sorted(by_comp.items())),
                          tuple(self._components()))

    def load_memory_copy(self, iteration: int, plan: ParallelPlan,
                         read: Callable[[str], list[MemoryPiece]]) -> None:
        """Build this worker's shards of ``plan`` from the memory copies of ``iteration``:
        each component's TP parts joined along the dimension they were split on."""

        def full(comp: str) -> dict[str, list[Tensor]]:
            parts = sorted(read(comp), key=lambda p: p.part)
            out: dict[str, list[Tensor]] = {}
            for name, ts in parts[0].tensors.items():
                d = shard_dim(name)
                if d is None or len(parts) == 1:
                    out[name] = list(ts)
                else:
                    out[name] = [torch.cat([p.tensors[name][k] for p in parts], d) for k in range(len(ts))]
            return out

        self._load_full(iteration, plan, full)

    def _load_full(self, iteration: int, plan: ParallelPlan,
                   component: Callable[[str], dict[str, list[Tensor]]]) -> None:
        """This worker's shards of ``plan``, taken from the full tensors ``component``
        gives for each component, as the state after ``iteration``."""
        self.plan = plan
        self.module = self._new_module(self.plan)
        self.optimizer.state.clear()
        self.steps = iteration + 1
        if self.module is not None:
            tp = self.module.tp
            comps: dict[str, dict[str, list[Tensor]]] = {}
            with torch.no_grad():
                for name, p in self._params().items():
                    comp = state.component_of(name)
                    if comp not in comps:
                        comps[comp] = component(comp)
                    d = shard_dim(name)
                    fp, fm, fv = (t.to(device=p.device, dtype=p.dtype) for t in comps[comp][name])
                    pick = (lambda t: t) if d is None else (lambda t: t.chunk(tp.size, d)[tp.rank])
                    p.copy_(pick(fp))
                    self.optimizer.state[name] = (pick(fm).clone(), pick(fv).clone())

    # ------------------------------------------------------------- execution
    def profile(self) -> IterationProfile | None:
        st = self._last
        if st is None or self._where is None:
            return None
        r, s, _ = self._where
        mbs = tuple(
            MicroBatchProfile(owner=o, mb=j, forward_s=st.forward_s[(o, j)],
                              backward_s=st.backward_s.get((o, j), 0.0),
                              doc_lengths=lengths_of(self.data, st.iteration, *self._data_index(o, j)))
            for (o, j) in st.forward_s
        )
        return IterationProfile(
            rank=self.device, device=self.device,  # the Detector keys workers by device id
            generation=self.comms.generation if self.comms else 0, iteration=st.iteration,
            stage=s, replica=r, microbatches=mbs, comm_s=st.comm_s, iteration_s=st.iteration_s,
        )

    def _step_number(self, iteration: int) -> int:
        """AdamW's step number for ``iteration``'s update (1-based): the iteration's own
        count, so it survives any move of state."""
        return iteration + 1

    def _data_index(self, owner: int, mb: int) -> tuple[int, int]:
        """The job's data shard of the plan's micro-batch (owner, mb). A restore onto
        fewer replicas keeps the global batch (dp x m constant) with another split, so
        micro-batches are numbered globally and mapped back to the original shards."""
        g = owner * self.plan.num_microbatches + mb
        return divmod(g, self.data.num_microbatches)

    def _stretch(self, timer: ChunkTimer) -> float:
        """Measure a compute chunk (device time: CUDA events on a GPU); under injected
        slowdown, sleep so it takes longer."""
        return self.ctx.faults.stretch(timer.stop())

    def run_iteration(self, program: Program, iteration: int) -> IterationResult:
        """Execute one iteration of ``program`` (this executor's share of the work)."""
        plan, comms, mod = self.plan, self.comms, self.module
        r, s, t = self._where
        me = plan.group(r, s)
        tp_group = comms.tp.get((r, s))
        denom = float(label_count(self.data, iteration))
        st = IterationResult(iteration)
        acts: dict[tuple[int, int], Tensor] = {}  # received inputs (need grad)
        outs: dict[tuple[int, int], Tensor] = {}
        grads_out: dict[tuple[int, int], Tensor] = {}
        grads_in: dict[tuple[int, int], Tensor] = {}
        params = list(mod.parameters())
        shape = lambda o, j: (sum(lengths_of(self.data, iteration, *self._data_index(o, j))), self.config.hidden)  # noqa: E731
        t_iter = time.perf_counter()
        for step, op in enumerate(program.ops):
            self.ctx.step(iteration, step)
            if isinstance(op, LoadMicroBatch):
                continue
            key = (getattr(op, "owner", -1), getattr(op, "mb", -1))
            if isinstance(op, RecvActivation):
                t0 = time.perf_counter()
                self.ctx.faults.delay_comm()
                src = plan.group(op.peer, s - 1)
                x = comm.recv_chunks(shape(*key), self.config.torch_dtype, src, t, me, comms, tp_group,
                                     comm.p2p_tag(0, s - 1, op.owner, op.mb, 0, plan))
                acts[key] = x.requires_grad_()
                st.comm_s += time.perf_counter() - t0
            elif isinstance(op, Forward):
                t0 = self.placement.timer().start()
                mbatch = micro_batch(self.data, iteration, *self._data_index(op.owner, op.mb))
                x = self.placement.to_home(mbatch.tokens) if s == 0 else acts[key]
                if s == plan.pp - 1:
                    out = mod(x, mbatch.lengths, self.placement.to_home(mbatch.labels)) / denom
                    st.loss += float(out.detach())
                else:
                    out = mod(x, mbatch.lengths)
                outs[key] = out
                st.forward_s[key] = self._stretch(t0)
                st.computed.append((s, op.owner, op.mb))
            elif isinstance(op, SendActivation):
                comm.send_chunks(outs[key].detach(), me, t, plan.group(op.peer, s + 1), comms,
                                 comm.p2p_tag(0, s, op.owner, op.mb, 0, plan))
            elif isinstance(op, RecvGrad):
                t0 = time.perf_counter()
                self.ctx.faults.delay_comm()
                grads_out[key] = comm.recv_chunks(
                    shape(*key), self.config.torch_dtype, plan.group(op.peer, s + 1), t, me, comms,
                    tp_group, comm.p2p_tag(1, s + 1, op.owner, op.mb, 0, plan))
                st.comm_s += time.perf_counter() - t0
            elif isinstance(op, Backward):
                t0 = self.placement.timer().start()
                out, g = outs[key], grads_out.pop(key, None)
                if not op.split:
                    torch.autograd.backward(out, g)
                    if s > 0:
                        grads_in[key] = acts[key].grad
                elif s > 0:
                    (grads_in[key],) = torch.autograd.grad(out, acts[key], g, retain_graph=True)
                if op.split:
                    grads_out[key] = g  # kept for W
                else:
                    outs.pop(key), acts.pop(key, None)
                st.backward_s[key] = st.backward_s.get(key, 0.0) + self._stretch(t0)
            elif isinstance(op, BackwardWeight):
                t0 = self.placement.timer().start()
                out, g = outs.pop(key), grads_out.pop(key)
                torch.autograd.backward(out, g, inputs=params)
                acts.pop(key, None)
                st.backward_s[key] = st.backward_s.get(key, 0.0) + self._stretch(t0)
            elif isinstance(op, SendGrad):
                comm.send_chunks(grads_in.pop(key).detach(), me, t, plan.group(op.peer, s - 1), comms,
                                 comm.p2p_tag(1, s, op.owner, op.mb, 0, plan))
            elif isinstance(op, ReduceGrads):
                t0 = time.perf_counter()
                self.ctx.faults.delay_comm()
                comm.wait_pending(comms)
                named = self._params()
                grads = []
                for name in sorted(named):
                    p = named[name]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append((p.grad, shard_dim(name)))
                comm.reduce_grads(s, self.device, t, len(me), grads, comms)
                st.comm_s += time.perf_counter() - t0
            elif isinstance(op, OptimizerStep):
                self.steps = self._step_number(iteration)
                named = self._params()
                self.ctx.faults.corrupt("grad", {n: p.grad for n, p in named.items()})  # injected SDC only
                self._grad_norm = None
                if self._watch_grads and sdc.same_layout_replicas(plan, r, s) < 2:
                    # the range signal, where no replica compares this state (docs/sdc.md)
                    self._grad_norm = sdc.grad_norm(p.grad for p in named.values())
                self.optimizer.step(named, self.steps)
                self.ctx.faults.corrupt("param", {n: p.data for n, p in named.items()})
                self.ctx.faults.corrupt("optimizer", {n: self.optimizer.ensure(n, p)[0] for n, p in named.items()})
                for p in params:
                    p.grad = None
            else:
                raise TypeError(f"megatron_ref cannot execute primitive {op!r}")
        comm.wait_pending(comms)
        if self.placement.is_cuda:
            torch.cuda.synchronize(self.placement.device)  # the iteration ends when its kernels do
        self._last = st
        st.iteration_s = time.perf_counter() - t_iter
        return st
