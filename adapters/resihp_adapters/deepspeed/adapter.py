"""The DeepSpeed adapter: ResiHP's contract (``resihp_core.adapter``) on a real
DeepSpeed ``PipelineEngine``.

- **communicator rebuild**: per plan generation the old engine's layer state is taken
  out, every group DeepSpeed holds is dropped and the default group destroyed
  (:mod:`.world`); the plan's executors join a new world under ``gen{g}/`` and a new
  :class:`~.engine.ResiPipelineModule` / :class:`~.engine.ResiPipelineEngine` is built
  for the new topology (replicas with no devices are left out of DeepSpeed's grid).
- **primitive emission**: the worker's program is lowered to DeepSpeed instructions
  (:func:`~.engine.lower_program`), with explicit-rank point-to-point for migrated work.
- **state**: parameters and optimizer state move by global layer index
  (:mod:`.state`); checkpoints are per-layer files, so a restore works onto any layout.

A plan that keeps only part of a replica (a dead rank's stage work migrated to another
replica) runs as it is with ZeRO 0 in fp32/fp64: DeepSpeed's grid gets holes
(:class:`~.engine.PartialTopology`) and every survivor keeps working. With ZeRO 1 or bf16
``resihp launch`` plans whole replicas only and re-stages the survivors
(:func:`~.plugin.capabilities_for`); a partial-replica plan from elsewhere runs as its
whole-replica equivalent (:func:`~.engine.whole_replicas`): that replica's remaining
work migrates to a whole replica and its devices idle (they still report and commit,
with no work). Either way the same pieces run on the same data, so the result is
unchanged (``docs/deepspeed.md``, partial replicas).

Loss scaling follows the contract's global batch: each micro-batch loss is divided by
``job.dp * job.num_microbatches / live replicas`` and DeepSpeed averages over its live
replicas (with partial replicas: by the whole global batch, and each stage's gradients
are summed), so the gradient is the global mean whatever the plan. Micro-batch
``(owner, mb)`` of a plan with ``m`` per replica is global micro-batch ``owner * m + mb``,
read as data shard ``divmod(g, job.num_microbatches)``.

ZeRO 1 (DeepSpeed's own optimizer): each stage's optimizer state is partitioned over
its replicas; every surviving holder sends its fragment and each rank fills its new
partition from them. A fragment whose only holder died makes every rank raise
``StateLost`` and the supervisor restores the newest checkpoint (``docs/deepspeed.md``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resihp_core.adapter import Adapter, AdapterContext, IterationResult, Shard
from resihp_core.config import ConfigError
from resihp_core.detector.sdc import Fingerprint
from resihp_core.detector.sdc import enabled as sdc_enabled
from resihp_core.detector.sdc import windows as sdc_windows
from resihp_core.plan import ParallelPlan
from resihp_core.protocols.checkpoints import CheckpointWrite
from resihp_core.program import Program

from resihp_adapters.deepspeed.plugin import CAPABILITIES, NAME
from resihp_adapters.deepspeed.spec import (PipelineSpec, check_supported, optimizer_factory, spec_from_adapter_config,
                                            torch_optimizer_config)

if TYPE_CHECKING:
    from resihp_adapters.torchkit.checkpoint import SealedWriter

__all__ = ["DeepSpeedAdapter"]


class DeepSpeedAdapter(Adapter):
    """One device's DeepSpeed pipeline engine across plan generations."""

    name = NAME
    capabilities = CAPABILITIES

    def __init__(self, ctx: AdapterContext, spec: PipelineSpec | None = None) -> None:
        super().__init__(ctx)
        import torch

        from resihp_adapters.deepspeed.data import MicroBatchSource
        from resihp_adapters.deepspeed.world import prepare_deepspeed

        from resihp_adapters.torchkit.device import placement_for

        # DeepSpeed's pipeline sends CUDA tensors itself: a GPU only with NCCL (docs/gpu.md).
        self.placement = placement_for(ctx.device, ctx.job.adapter_config, own_transfers=False)
        if self.placement.is_cuda:
            os.environ["LOCAL_RANK"] = str(self.placement.device.index)  # DeepSpeed's device
        elif torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self._watch: Any = None
        self._sdc = _sdc_step(ctx)  # injected flips and the range signal at the step (deepspeed/sdc.py)
        self.spec = spec if spec is not None else spec_from_adapter_config(ctx.job.adapter_config, ctx.job)
        check_supported(self.spec.config)
        self.zero_stage = int((self.spec.config.get("zero_optimization") or {}).get("stage", 0))
        self.config = torch_optimizer_config(self.spec.config, log=lambda m: print(f"resihp: {m}", flush=True))
        self.optimizer_factory = optimizer_factory(self.spec.optimizer)
        self.source = MicroBatchSource(self.spec.dataset, self.spec.collate_fn or MicroBatchSource.default_collate,
                                       self.spec.micro_batch_size, ctx.job.num_microbatches, ctx.job.dp,
                                       shuffle=self.spec.shuffle, seed=self.spec.data_seed)
        self.engine: Any = None
        self.plan: ParallelPlan | None = None  # the plan as posted (``where`` refers to it)
        self.xplan: ParallelPlan | None = None  # the whole-replica plan DeepSpeed runs
        self._held: dict[int, dict[str, Any]] = {}  # layer state while no engine exists
        self.idle_global: dict[str, Any] | None = None  # the GLOBAL unit an idle rank's get_lr() reads
        # Whether the engine holds the job's state: not between a rebuild and a state move
        # (or load) that succeeded. A failed move leaves the previous generation's state
        # in ``_held`` for the next plan (the contract: move_state puts it back).
        self._current = False
        # Rollback snapshots, oldest first (at most ``_depth``), and the buffers of one
        # that a rollback undid, for the next snapshot to reuse.
        self._snaps: list[_Snapshot] = []
        self._depth = 1
        self._spare: dict[Any, dict[str, Any]] | None = None
        self._build = 0  # counts engines built: a snapshot belongs to one
        self._generation = -1  # the plan generation the adapter last entered (not the job's stop)
        self._at_newest = False  # the engine holds the newest snapshot's state (rolled back to it)
        self._writer: SealedWriter | None = None  # the background checkpoint writer, made at the first checkpoint
        self._staging: dict[Any, dict[str, Any]] | None = None  # its host buffers, kept across checkpoints
        self._program: Program | None = None
        self.last_loss: float | None = None  # DeepSpeed's aggregated loss of the last iteration
        self._last: IterationResult | None = None
        self._ckpt_status: list[CheckpointWrite] = []  # checkpoint writes finished since the last report
        self._initial: dict[int, tuple[tuple[int, int], ...]] = {}  # initial split per stage count
        self._initial_pp: int | None = None  # the job's first stage count (initial_stages)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        prepare_deepspeed(ctx.timeout_s)
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != self.placement.device.type:
            raise ConfigError(f"this worker computes on {self.placement.device} ({self.placement.reason}), but "
                              f"DeepSpeed's accelerator is {get_accelerator().device_name()!r} (set DS_ACCELERATOR "
                              "before DeepSpeed is imported, or choose another backend)",
                              path="runtime.backend", value=ctx.job.adapter_config.get("backend", "auto"))

    # ------------------------------------------------------------------ where
    @property
    def where(self) -> tuple[int, int, int] | None:
        if self.plan is None:
            return None
        return self.plan.location(self.ctx.device)

    @property
    def idle(self) -> bool:
        """In the posted plan but left out of the whole-replica plan DeepSpeed runs."""
        return self.where is not None and self.engine is None

    # ------------------------------------------------------------------ communicators
    def _drop_engine(self) -> None:
        from resihp_adapters.deepspeed.state import extract_layers
        from resihp_adapters.deepspeed.world import teardown_world

        from resihp_adapters.deepspeed.world import dismantle

        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self.engine is not None and self._current:
            self._held = extract_layers(self.engine)
        engine, self.engine = self.engine, None
        dismantle(engine)
        del engine
        self._program = None
        teardown_world(self.placement)

    def rebuild_communicators(self, plan: ParallelPlan, generation: int, devices: list[int]) -> None:
        from resihp_adapters.deepspeed.engine import device_rank, is_partial, plan_topology
        from resihp_adapters.deepspeed.world import bound_op_timeouts, build_engine, ds_config_for, init_world

        self._drop_engine()
        self.plan = plan
        self._generation = generation
        if generation == 0:
            self.initial_stages(generation)  # remembered also by a standby that runs later
        xplan = self.xplan = self.runnable(plan)
        where = xplan.location(self.ctx.device)
        how = "partial-replica plan" if is_partial(xplan) else (
            "whole-replica equivalent" if xplan is not plan else "plan")
        print(f"resihp: generation {generation}: device {self.ctx.device} "
              + (f"runs replica {where[0]} stage {where[1]} ({how})" if where is not None else
                 f"idles: {self.idle_reason(plan)}" if plan.location(self.ctx.device) is not None
                 else "is a standby"),
              file=sys.stderr, flush=True)
        if generation == 0 and self.spec.partition_method != "uniform" and \
                tuple(plan.layer_ranges) != self.initial_ranges(plan.pp):
            raise ConfigError(f"the first plan splits the layers {list(plan.layer_ranges)}, but DeepSpeed's "
                              f"partition_method={self.spec.partition_method!r} splits them "
                              f"{list(self.initial_ranges(plan.pp))}: start the job with 'resihp launch', which "
                              "plans DeepSpeed's split (docs/deepspeed.md)", path="partition_method",
                              value=self.spec.partition_method)
        if where is None:
            return  # a standby, or idle in this generation: no place in DeepSpeed's grid
        plan = xplan
        live = _live(plan)
        init_world(self.ctx.store, generation, device_rank(plan, self.ctx.device), len(plan.devices()),
                   self.ctx.timeout_s, self.placement)
        job = self.ctx.job
        cfg = ds_config_for(self.config, micro_batch_size=self.spec.micro_batch_size,
                            num_microbatches=plan.num_microbatches, replicas=len(live))
        parts = [a for a, _ in plan.layer_ranges] + [plan.num_layers]
        if plan.num_layers != len(self.spec.layers):
            raise ValueError(f"plan has {plan.num_layers} layers, the model has {len(self.spec.layers)}")
        engine = build_engine(self.spec.layers, parts=parts, topology=plan_topology(plan), config=cfg,
                              optimizer=self.optimizer_factory, loss_fn=self.spec.loss_fn,
                              base_seed=self.spec.base_seed, lr_scheduler=self.spec.lr_scheduler,
                              activation_checkpoint_interval=self.spec.activation_checkpoint_interval,
                              checkpointable_layers=self.spec.checkpointable_layers,
                              seed_layers=self.spec.seed_layers,
                              # Unseeded, the first generation draws what plain DeepSpeed's module draws.
                              count_build=(generation == 0 and not self.spec.seed_layers
                                           and self.spec.partition_method == "parameters"))
        # A partial-replica plan sums its stages' gradients instead of averaging them
        # (their replica counts differ): each loss is divided by the whole global batch.
        engine.loss_divisor = job.dp * job.num_microbatches / (1 if is_partial(plan) else len(live))
        m = plan.num_microbatches
        engine.micro_batch_address = lambda owner, mb: divmod(owner * m + mb, job.num_microbatches)
        engine.rng_microbatches = job.num_microbatches
        engine.clip_norm_layers = range(*self.initial_ranges(self.initial_stages(generation))[0])
        engine.step_hook = self.ctx.step
        engine.fault_hook = self._fault
        engine.sdc_step = self._sdc
        if self._sdc is not None:
            self._sdc.build(engine, plan, self.ctx.device)
        bound_op_timeouts(self.ctx.timeout_s, self.ctx.superseded)
        self.engine = engine
        self._build += 1
        self._at_newest = False
        self._current = False
        from resihp_adapters.torchkit.device import AbortWatch

        self._watch = AbortWatch(self.placement, self.ctx.superseded).start()

    @property
    def partial_replicas(self) -> bool:
        """Whether this job runs a plan that keeps part of a replica as it is (its
        surviving ranks keep their stages; docs/deepspeed.md, partial replicas): ZeRO 0
        and fp32/fp64. Otherwise such a plan runs as its whole-replica equivalent."""
        return self.zero_stage == 0 and not (self.config.get("bf16") or {}).get("enabled")

    def idle_reason(self, plan: ParallelPlan) -> str:
        """Why a device the plan places runs nothing: its replica lost a stage and this
        job cannot run a partial replica as it is (docs/deepspeed.md, partial replicas)."""
        from resihp_adapters.deepspeed.engine import partial_runnable

        r = plan.location(self.ctx.device)
        if r is None:
            return "not in the plan"
        if not self.partial_replicas:
            what = " and ".join(w for w, on in (("ZeRO stage 1", self.zero_stage >= 1),
                                                ("bf16", bool((self.config.get("bf16") or {}).get("enabled"))))
                                if on)
            cause = (f"{what} reduces and partitions gradients and optimizer state with DeepSpeed's own per-stage "
                     "data-parallel averaging, which a replica missing a stage would skew")
        elif not partial_runnable(plan):
            cause = "a partial replica runs as it is only with TP degree 1 and more than one stage"
        else:
            cause = "its replica runs as its whole-replica equivalent"
        return (f"replica {r[0]} lost a stage; its remaining work runs on a whole replica "
                f"(whole-replica equivalent: {cause}; docs/deepspeed.md, partial replicas)")

    def runnable(self, plan: ParallelPlan) -> ParallelPlan:
        """The plan DeepSpeed runs for ``plan`` (the same on every rank)."""
        from resihp_adapters.deepspeed.engine import is_partial, partial_runnable, whole_replicas

        if is_partial(plan) and self.partial_replicas and partial_runnable(plan):
            return plan
        return whole_replicas(plan)

    def _fault(self, kind: str, seconds: float) -> None:
        if kind == "compute":
            self.ctx.faults.stretch(seconds)
        else:
            self.ctx.faults.delay_comm()

    def release(self) -> None:
        self._drop_engine()

    # ------------------------------------------------------------------ state
    def start_fresh(self, plan: ParallelPlan) -> None:
        """Fresh weights come from the layer specs, seeded per global layer index
        (``seed_layers``), so every layout starts from the same model."""
        self._at_newest = False
        self._held = {}
        self._current = True

    def check_move(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> None:
        """The unit plan of :meth:`move_state` from the plans and the model's specs alone
        (the engine is gone after a failure): raises ``LayersLost`` before the rendezvous.
        A ZeRO 1 fragment lost with its only holder is still found inside the move."""
        from resihp_adapters.deepspeed.state import tied_of_specs, transfer_plan

        old, new = self.runnable(old_plan), self.runnable(new_plan)
        have = set(devices) & set(old.devices()) & set(new.devices())
        transfer_plan(old, new, have, tied_of_specs(self.spec.layers), sharded=self.zero_stage >= 1)

    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> int:
        import torch
        import torch.distributed as tdist

        from resihp_adapters.deepspeed.state import (ShardsLost, ShardsMissing, apply_units, exchange_layers,
                                                     is_sharded, merge_units, tied_layers, transfer_plan, unit_keys)

        self._at_newest = False

        if self.engine is None:
            return 0  # a standby (or idle device) keeps what it held
        old_plan, new_plan = self.runnable(old_plan), self.xplan
        have = set(devices) & set(old_plan.devices()) & set(new_plan.devices())
        sharded = is_sharded(self.engine)
        transfers = transfer_plan(old_plan, new_plan, have, tied_layers(self.engine), sharded=sharded)
        mine = self._held if self.ctx.device in old_plan.devices() else {}
        received, nbytes = exchange_layers(self.ctx.device, new_plan, transfers, mine)
        local = unit_keys(self.engine)
        units = {i: st for i, st in mine.items() if i in local}
        missing = [u for u in local if u not in units and u not in received]
        for u, st in received.items():
            units[u] = merge_units(units[u], st) if u in units else st
        gap = None
        try:
            apply_units(self.engine, units)
        except ShardsMissing as e:
            gap = str(e)
        if sharded:
            # ZeRO 1: whether a dead rank held the only copy of some fragment is known
            # only where it is needed; every rank raises alike (docs/deepspeed.md, ZeRO).
            flag = torch.tensor([0 if gap is None else 1])
            from resihp_adapters.deepspeed.engine import all_reduce

            all_reduce(flag, op=tdist.ReduceOp.MAX)
            if int(flag):
                raise ShardsLost(gap or "another rank's ZeRO 1 optimizer shard died with its only holder; "
                                 "restore from a checkpoint")
        if missing:
            raise RuntimeError(f"device {self.ctx.device}: no state arrived for units {missing}")
        self._held = {}
        self._current = True
        return nbytes

    def snapshot(self) -> None:
        """The rollback point of the coming iteration: a copy of every unit, written into
        the buffers of the oldest snapshot it replaces (or of one a rollback undid), so
        no buffers are allocated while the layout stays. Its iteration is the one
        :meth:`run_iteration` runs next. ``keep_snapshots(2)`` keeps the one before it
        too (:meth:`rollback_to`)."""
        from resihp_adapters.deepspeed.state import snapshot_units

        snaps = self._snaps
        if self.engine is None:
            snaps.clear()  # idle or a standby: it holds no state of the job's
            self._spare = None
            return
        if snaps and snaps[0].build != self._build:
            # Another engine's (an earlier generation): nothing rolls back to it any more.
            self._spare, snaps[:] = snaps[-1].units, []
        if snaps and (snaps[-1].iteration is None or self._at_newest):
            # Taken again before its iteration ran, or right after a rollback to it: the
            # state is the newest's, which this copy replaces.
            slot = snaps.pop().units
        elif len(snaps) >= self._depth:
            slot = snaps.pop(0).units
        else:
            slot, self._spare = self._spare, None
        self._at_newest = False
        # Peers may still be sending a memory copy (references to a snapshot): new buffers.
        reuse = None if self.capabilities.memory_copy else slot
        snaps.append(_Snapshot(snapshot_units(self.engine, reuse), self._build))

    def keep_snapshots(self, depth: int) -> bool:
        """Keep the last ``depth`` (1 or 2) snapshots: with 2 the worker commits an
        iteration in the background while the next one runs, and a refused commit
        goes back two steps (:meth:`rollback_to`; docs/deepspeed.md)."""
        if depth not in (1, 2):
            raise ValueError(f"snapshot depth is 1 or 2, not {depth}")
        self._depth = depth
        del self._snaps[:-depth]
        return True

    def rollback(self) -> None:
        """Back to the newest snapshot (an iteration that did not commit everywhere)."""
        if self._snaps:
            self._restore(len(self._snaps) - 1)

    def rollback_to(self, iteration: int) -> None:
        """Back to the state at the start of ``iteration``: the newest snapshot, or with
        two kept the one before it (the commit of ``iteration`` was refused after the
        next iteration had stepped: both are undone)."""
        at = [k for k, s in enumerate(self._snaps) if s.iteration == iteration]
        if not at:
            if self.engine is None and not self._snaps:
                return  # idle or a standby: it ran no step to undo
            raise RuntimeError(f"device {self.ctx.device}: no snapshot of iteration {iteration} to roll back to "
                               f"(kept: {[s.iteration for s in self._snaps]})")
        self._restore(at[-1])

    def _restore(self, k: int) -> None:
        """Put snapshot ``k`` back; the newer ones are dropped (their buffers reused)."""
        from resihp_adapters.deepspeed.state import apply_layers, zero_grads

        snaps = self._snaps
        undone = snaps[k + 1:]
        del snaps[k + 1:]
        if undone:
            self._spare = undone[0].units
        if self.engine is not None:
            # Applying copies every value (nothing of the engine's refers to the
            # snapshot), so it stays the newest and a retry of the iteration reuses it.
            apply_layers(self.engine, snaps[k].units)
            zero_grads(self.engine)
            self._at_newest = True
        else:
            # Released after the failure: the snapshot is the state the next plan's
            # move takes out of this rank (handed over, its buffers no longer reused).
            self._held = snaps[k].units
            snaps.clear()
            self._spare = None

    # ------------------------------------------------------------------ iterations
    def run_iteration(self, program: Program, iteration: int) -> IterationResult:
        import torch

        e = self.engine
        if e is None:
            if self.where is None:
                raise RuntimeError(f"device {self.ctx.device} is a standby and has no program to run")
            return IterationResult(iteration=iteration)  # idle: its work runs on a whole replica
        if self._program is None:
            if self.xplan is not self.plan:
                # The posted program assumes the partial replica; run the whole-replica one.
                from resihp_core.predictor.schedules import emit_programs

                r, s_, _ = self.xplan.location(self.ctx.device)
                program = {(p.replica, p.stage): p for p in emit_programs(self.xplan)}[(r, s_)]
            e.set_work(self.xplan, program, self.source)
            self._program = program
        program = self._program
        if self._snaps and self._snaps[-1].iteration is None:
            self._snaps[-1].iteration = iteration  # the snapshot taken for this iteration
        self._at_newest = False
        e.iteration = iteration
        e.global_steps = iteration
        t0 = time.perf_counter()
        agg = e.train_batch()
        dt = time.perf_counter() - t0
        # DeepSpeed counts samples by this generation's batch; the job's batch is fixed.
        job = self.ctx.job
        e.global_samples = e.iteration * job.dp * job.num_microbatches * self.spec.micro_batch_size
        self.last_loss = float(agg) if agg is not None else None
        res = IterationResult(iteration=iteration, iteration_s=dt)
        for kind, owner, mb, sec in e.timings:
            if kind == "F":
                res.computed.append((program.stage, owner, mb))
                res.forward_s[(owner, mb)] = sec
            else:
                res.backward_s[(owner, mb)] = sec
        self._last = res
        if e.is_last_stage() and e.total_loss is not None:
            job = self.ctx.job
            total = e.total_loss if isinstance(e.total_loss, torch.Tensor) else e.total_loss[0]
            res.loss = float(total) / (job.dp * job.num_microbatches)
        return res

    def fingerprint(self) -> Fingerprint | None:
        """This device's parameters and a window of its optimizer state after its last
        step (ZeRO 0, no bf16; deepspeed/sdc.py); None where replicas do not hold the
        same state."""
        from resihp_adapters.deepspeed import sdc as ds_sdc

        if self.idle or self._last is None or self.plan is None:
            return None
        return ds_sdc.fingerprint(self.engine, self.plan, self.ctx.device, self._last.iteration + 1,
                                  *sdc_windows())

    def sdc_signals(self) -> dict[str, float]:
        """The L2 norm of this device's reduced gradients at its last step."""
        g = self._sdc.grad_norm if self._sdc is not None else None
        return {} if g is None else {"grad_norm": g}

    def profile(self):
        """Per micro-batch forward/backward times of the last iteration, for the Detector.
        DeepSpeed pipelines send fixed-shape micro-batches, so each sample counts as one
        unit-length document (the cost model then fits a constant per micro-batch)."""
        from resihp_core.protocol import IterationProfile, MicroBatchProfile

        r, e, where = self._last, self.engine, self.where
        if r is None or e is None or where is None:
            return None
        docs = (1,) * self.spec.micro_batch_size
        mbs = tuple(MicroBatchProfile(owner=o, mb=j, forward_s=f, backward_s=r.backward_s.get((o, j), 0.0),
                                      doc_lengths=docs) for (o, j), f in r.forward_s.items())
        return IterationProfile(rank=self.ctx.device, device=self.ctx.device, generation=max(self.ctx.generation, 0),
                                iteration=r.iteration, stage=where[1], replica=where[0], microbatches=mbs,
                                comm_s=r.comm_s, iteration_s=r.iteration_s)

    def held_state(self) -> dict[str, Shard]:
        from resihp_adapters.deepspeed.state import extract_units, param_name

        if self.idle:
            return {}  # left out of the run: what it holds is not current
        units = extract_units(self.engine) if self.engine is not None else self._held
        where = self.where
        t = where[2] if where is not None else 0
        tp = self.plan.degree(*where[:2]) if where is not None else 1
        out = {}
        for key, st in units.items():
            for name, p in st.get("params", {}).items():
                opt = st["opt"].get(name, {})
                # bf16: the fp32 master weights are what the optimizer steps.
                p = st.get("master", {}).get(name, p)
                tensors = (p, *(opt[k] for k in sorted(opt) if hasattr(opt[k], "dim") and opt[k].dim() > 0))
                # Uniform TP: a layer shards itself over DeepSpeed's model-parallel group in
                # its own way, so a TP piece is named by its TP index, not placed.
                full = param_name(key, name)
                out[full if tp == 1 else f"{full}@tp{t}"] = Shard(tensors)
        return out

    def initial_ranges(self, pp: int) -> tuple[tuple[int, int], ...]:
        """The job's initial stage split over ``pp`` stages: the one DeepSpeed's
        ``PipelineModule`` makes for the script's ``partition_method`` (:mod:`.partition`),
        which the first plan of ``resihp launch`` runs. DeepSpeed's gradient clipping and
        its checkpoint files refer to it."""
        from resihp_adapters.deepspeed.partition import deepspeed_parts, parts_to_ranges

        if pp not in self._initial:
            self._initial[pp] = parts_to_ranges(deepspeed_parts(self.spec.layers, pp, self.spec.partition_method))
        return self._initial[pp]

    def initial_stages(self, generation: int) -> int:
        """The job's initial stage count (the current plan's may be smaller after a
        shrink): stage 0 of *its* split is what DeepSpeed's gradient clipping counts, so
        the clip norm must keep referring to it. It is generation 0's stage count; a
        worker whose first plan is a later one reads the config's ``resihp.pp`` (what
        ``resihp launch`` starts the job with). Without either, and with clipping on,
        that is refused rather than clipping by another norm."""
        if self._initial_pp is None:
            if generation == 0 and self.plan is not None:
                self._initial_pp = self.plan.pp
            else:
                self._initial_pp = self._launch_stages()
        if self._initial_pp is None:
            if float(self.config.get("gradient_clipping") or 0.0) > 0.0:
                raise ConfigError(f"device {self.ctx.device} first joins the job at plan generation {generation}, "
                                  "so it does not know the job's initial stage count, whose stage 0 DeepSpeed's "
                                  "gradient clipping counts: set resihp.pp in the DeepSpeed config "
                                  "(docs/deepspeed.md, gradient clipping)", path="resihp.pp", value=None)
            return self.plan.pp if self.plan is not None else 1  # no clipping: the norm is unused
        return self._initial_pp

    def _launch_stages(self) -> int | None:
        """The stage count ``resihp launch`` starts the job with (its config section's
        ``pp``, default 2), or None for a job not configured through it."""
        sec = self.spec.resihp
        return int(sec.get("pp", 2)) if "pp" in sec or "num_layers" in sec else None

    def check_initial_layout(self, what: str) -> None:
        """DeepSpeed's own checkpoint files describe one layout (the stage split; with
        ZeRO 1 also the data-parallel degree): refuse ``what`` unless the engine runs
        the job's initial one, which plain DeepSpeed has too."""
        from resihp_adapters.deepspeed.engine import live_replicas

        x, job = self.xplan, self.ctx.job
        if x is None:
            raise RuntimeError(f"{what}: no plan generation yet")
        # The job's initial stage count, not this plan's: a restore onto fewer stages
        # runs a split DeepSpeed's files of the initial layout do not describe.
        initial = self.initial_ranges(self._initial_pp or self._launch_stages() or x.pp)
        from resihp_adapters.deepspeed.engine import is_partial

        if is_partial(x):
            raise RuntimeError(f"{what} in DeepSpeed's format: this plan generation keeps only part of a replica, "
                               "which DeepSpeed's files cannot describe (ResiHP's own checkpoints load onto any layout)")
        if tuple(x.layer_ranges) != initial or (
                self.zero_stage >= 1 and len(live_replicas(x)) != job.dp):
            raise RuntimeError(
                f"{what} in DeepSpeed's format: the job now runs layers {list(x.layer_ranges)} on "
                f"{len(live_replicas(x))} replica(s), not its initial {list(initial)} on {job.dp}; "
                "DeepSpeed's files would not load into a plain DeepSpeed job (ResiHP's own checkpoints, "
                "checkpoint_every, load onto any layout)")

    def full_state(self) -> dict[str, Any]:
        """DeepSpeed's own complete state of this rank, by layout-independent names
        (``docs/deepspeed.md``): every parameter (``"3.fc.weight"``, tied groups once as
        ``"tied_modules.embed.weight"``), bf16 master weights (``"master.<param>"``), the
        optimizer state per parameter (``"optimizer.<param>.<key>"``, step counts
        included), the hyperparameters per parameter group (the LR the scheduler set),
        the LR scheduler's state, the engine's step counters, the dropout RNG's seed
        rule and the data position (the next iteration). Empty on a rank that runs
        nothing (a standby, or idle in a partial replica)."""
        from resihp_adapters.deepspeed.engine import unbounded
        from resihp_adapters.deepspeed.state import flat_state

        if self.idle or self.engine is None:
            return {}
        with unbounded():  # a collective under ZeRO 1, also called after the job's stop
            out = flat_state(self.engine)
        out["data.iteration"] = int(self.engine.iteration)
        return out

    # ------------------------------------------------------------------ checkpoints
    # The core's layout (docs/checkpoints.md): per-unit files in ``layers/`` inside the
    # iteration's folder. The training thread copies the units into host buffers; a
    # background writer writes them and world rank 0's sealer seals the checkpoint once
    # every rank of the generation's world has said it finished
    # (:class:`~resihp_adapters.torchkit.checkpoint.SealedWriter`).
    LAYERS_FOLDER = "layers"

    def _ckpt_dir(self, iteration: int) -> str:
        from resihp_core import checkpoints

        base = self.ctx.job.checkpoint_dir
        if not base:
            raise RuntimeError("the job has no checkpoint_dir")
        return str(checkpoints.iteration_dir(base, iteration) / self.LAYERS_FOLDER)

    def save_checkpoint(self, iteration: int) -> None:
        """Each executor of the first live replica holding its stage hands its units
        (parameters and optimizer state, by global layer index and TP index) to the
        background writer, as host copies; under ZeRO 1 every rank also hands its
        fragments. Every rank of the generation's world says when it has finished
        (also with no files), and world rank 0 seals then, so the checkpoint is sealed
        only complete. A storage error is reported through :meth:`checkpoint_status`,
        not raised; nothing here waits for a peer."""
        import torch.distributed as tdist

        from resihp_adapters.deepspeed.state import is_sharded, snapshot_units, unit_name
        from resihp_adapters.torchkit.checkpoint import SealedWriter

        if self.engine is None:
            return  # idle or a standby: not in DeepSpeed's world
        if not self.ctx.job.checkpoint_dir:
            raise RuntimeError("the job has no checkpoint_dir")
        t0 = time.perf_counter()
        if self._writer is None:
            # A checkpoint sealed after a newer plan generation began applies no retention
            # (a restore may be loading what it would delete); the job's stop is none.
            self._writer = SealedWriter(generation=lambda: self._generation)
        w = self._writer
        if not w.wait_idle():  # the staging buffers are the previous write's until it finished
            w.give_up(iteration, f"the previous checkpoint write is still running after {w.busy_timeout_s:.0f} s")
            return
        r, stage, t = self.xplan.location(self.ctx.device)
        k = _live(self.xplan).index(r)
        # The first replica that holds this stage writes its units (with partial replicas
        # that need not be the first replica).
        first = next(q for q, rep in enumerate(self.xplan.tp_groups) if rep[stage])
        # ZeRO 1: every replica holds a fragment of the optimizer state, so every rank
        # also writes ``<unit>-tpT.zKsS.pt`` (replica K, stage S: a tied group's copies
        # on two stages are two sets of fragments); a load merges them.
        sharded = is_sharded(self.engine)
        files: dict[str, object] = {}
        if r == first or sharded:
            self._staging = snapshot_units(self.engine, self._staging, device="cpu")
            for key, st in self._staging.items():
                # Tied groups and the global unit are held by several stages: each
                # writes the same file (temporary name, then rename).
                names = ([f"{unit_name(key)}-tp{t}.pt"] if r == first else []) + (
                    [f"{unit_name(key)}-tp{t}.z{k}s{stage}.pt"] if sharded else [])
                files.update({f"{self.LAYERS_FOLDER}/{n}": st for n in names})
        w.submit(iteration, self.ctx.job.checkpoint_dir, files, generation=self._generation,
                 rank=tdist.get_rank(), writers=tdist.get_world_size(), keep=self.ctx.job.checkpoint_keep,
                 staged_s=time.perf_counter() - t0)

    def checkpoint_status(self) -> list[CheckpointWrite]:
        out, self._ckpt_status = self._ckpt_status, []
        return out + (self._writer.results() if self._writer is not None else [])

    def load_checkpoint(self, iteration: int, plan: ParallelPlan) -> None:
        import torch

        import glob

        from resihp_adapters.deepspeed.state import ShardsMissing, apply_layers, merge_units, unit_keys, unit_name

        self._at_newest = False

        if self.engine is None:
            self._held = {}
            # An idle rank's loop still asks get_lr(): keep the checkpoint's optimizer
            # groups and scheduler state for that only (idle.py); it is no state to move.
            f = os.path.join(self._ckpt_dir(iteration), "global-tp0.pt")
            self.idle_global = torch.load(f, weights_only=True) if os.path.exists(f) else None
            return
        path = self._ckpt_dir(iteration)
        t = self.xplan.location(self.ctx.device)[2]
        layers = {}
        for idx in unit_keys(self.engine):
            f = os.path.join(path, f"{unit_name(idx)}-tp{t}.pt")
            if not os.path.exists(f):
                raise FileNotFoundError(f"checkpoint of iteration {iteration} has no {unit_name(idx)} (TP index {t}): {f}")
            layers[idx] = torch.load(f, weights_only=True)
            for z in sorted(glob.glob(os.path.join(glob.escape(path), f"{unit_name(idx)}-tp{t}.z*.pt"))):
                layers[idx] = merge_units(layers[idx], torch.load(z, weights_only=True))  # ZeRO 1 fragments
        try:
            apply_layers(self.engine, layers)
        except ShardsMissing as e:
            raise FileNotFoundError(f"checkpoint of iteration {iteration}: {e}") from None
        self._held = {}
        self._current = True

    def close(self) -> None:
        from resihp_adapters.deepspeed.engine import join_abandoned
        from resihp_adapters.deepspeed.world import dismantle, teardown_world

        if self._writer is not None and not self._writer.drain():
            print(f"resihp: device {self.ctx.device}: the last checkpoint write did not finish within "
                  f"{self._writer.busy_timeout_s:.0f} s; it stays unsealed", file=sys.stderr, flush=True)
        join_abandoned()
        engine, self.engine = self.engine, None
        dismantle(engine)
        del engine
        teardown_world()


# ---------------------------------------------------------------------- helpers
def initial_stage0_layers(layers: list[Any], pp: int, method: str = "uniform") -> range:
    """The layers stage 0 holds in the job's initial partition (DeepSpeed's split for
    ``method``, as ``resihp launch`` starts): DeepSpeed's gradient clipping counts these."""
    from resihp_adapters.deepspeed.partition import deepspeed_parts

    return range(0, deepspeed_parts(layers, pp, method)[1])


def _sdc_step(ctx: AdapterContext) -> Any:
    """The optimizer-step wrapper for injected flips and the range signal (None with a
    stand-in fault injector that cannot flip)."""
    from resihp_adapters.deepspeed.sdc import SdcStep

    return SdcStep(ctx.faults, sdc_enabled(True)) if hasattr(ctx.faults, "corrupt") else None


@dataclass
class _Snapshot:
    """One rollback snapshot: every unit of this rank (:func:`~.state.snapshot_units`),
    the iteration it was taken before (None until that iteration starts) and the
    engine it was taken of (:attr:`DeepSpeedAdapter._build`)."""

    units: dict[Any, dict[str, Any]]
    build: int
    iteration: int | None = None


def _live(plan: ParallelPlan) -> list[int]:
    from resihp_adapters.deepspeed.engine import live_replicas

    return live_replicas(plan)
