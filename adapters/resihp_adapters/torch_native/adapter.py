"""The torch-native adapter: the contract (``resihp_core.adapter``) over the engine.

One instance per worker process. The engine (:mod:`.engine`) holds the torch objects of
the current plan generation; this class maps the worker's lifecycle onto it and reads
the adapter's own section of the job (``job.adapter_config``):

``model``   :class:`~.model.LlamaConfig` fields (vocab_size, dim, n_layers, n_heads,
            ffn_dim, dtype, ...); ``n_layers`` must equal the plan's layers.
``shard``   FSDP shard degree inside each stage's replicas: 0 (default) shards over all
            of them (FSDP2); a smaller divisor gives HSDP, whose replicate groups each
            hold a whole copy, so a dead rank's shard survives in memory.
``lr``, ``weight_decay``  AdamW.
``user``    ``module:function`` returning a user's job (``api.user_job(model, ...)``):
            the user's model, optimizer, scheduler and data in place of the above.

The training data is the job's own source (``job.data``, the ``[data]`` section), as
for every adapter: see :mod:`.data`.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from resihp_core.adapter import Adapter, AdapterContext, IterationResult, Shard
from resihp_core.detector.sdc import Fingerprint, digest_windows, seal, window_sum
from resihp_core.detector.sdc import windows as sdc_windows
from resihp_core.detector.sdc import enabled as sdc_enabled
from resihp_core.plan import ParallelPlan
from resihp_core.protocols.checkpoints import CheckpointWrite
from resihp_core.program import Program
from resihp_core.protocol import IterationProfile, MicroBatchProfile
from resihp_adapters.torch_native.async_checkpoint import AsyncDcpWriter
from resihp_adapters.torch_native.plugin import CAPABILITIES, NAME

if TYPE_CHECKING:
    from torch import Tensor

    from resihp_adapters.torch_native.api import UserJob
    from resihp_adapters.torch_native.engine import TorchNativeEngine

__all__ = ["TorchNativeAdapter", "parse_config"]

_KEYS = {"model", "shard", "lr", "weight_decay", "user", "backend", "devices_per_node"}


def parse_config(section: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Validate ``job.adapter_config``; errors name the bad field."""
    from resihp_adapters.torch_native.model import LlamaConfig

    if "data" in section:
        raise ValueError("adapter_config.data: torch_native trains on the job's data source (job.data, the "
                         "[data] section; docs/data.md), not on a data section of its own")
    unknown = sorted(set(section) - _KEYS)
    if unknown:
        raise ValueError(f"adapter_config: unknown field(s) {unknown} for torch_native (known: {sorted(_KEYS)})")
    model = dict(section.get("model", {}))
    model.setdefault("seed", seed)
    try:
        cfg = LlamaConfig(**model)
    except TypeError as e:
        raise ValueError(f"adapter_config.model: {e}") from None
    shard = section.get("shard", 0)
    if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0:
        raise ValueError(f"adapter_config.shard must be an integer >= 0, got {shard!r}")
    lr, wd = section.get("lr", 1e-3), section.get("weight_decay", 0.0)
    for name, v in (("lr", lr), ("weight_decay", wd)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"adapter_config.{name} must be a number >= 0, got {v!r}")
    user = section.get("user")
    if user is not None and (not isinstance(user, str) or ":" not in user):
        raise ValueError(f"adapter_config.user must be 'module:function' (a function returning "
                         f"resihp_adapters.torch_native.api.user_job(...)), got {user!r}")
    return {"model": cfg, "shard": shard, "lr": float(lr), "weight_decay": float(wd), "user": user}


def load_user(target: str) -> UserJob:
    """``adapter_config.user``: ``module:function`` returning the user's job (what
    ``initialize(model, ...)`` hands the adapter), for ``resihp run`` and the
    conformance kit, which build adapters from the job description alone."""
    import importlib

    from resihp_adapters.torch_native.api import UserJob

    mod, _, fn = target.partition(":")
    job = getattr(importlib.import_module(mod), fn)()
    if not isinstance(job, UserJob):
        raise TypeError(f"adapter_config.user: {target} returned {type(job).__name__}, not a UserJob "
                        "(resihp_adapters.torch_native.api.user_job(model, optimizer=..., dataset=...))")
    return job


class TorchNativeAdapter(Adapter):
    """Pipeline stages (torch.distributed.pipelining) sharded with FSDP2 / HSDP."""

    name = NAME
    capabilities = CAPABILITIES

    def __init__(self, ctx: AdapterContext, user: UserJob | None = None) -> None:
        """``user``: the script's model, optimizer, scheduler and data
        (:class:`~.api.UserJob`, from ``initialize(model, ...)``); None: the adapter's own
        LLaMA of ``adapter_config.model`` on the job's data source."""
        super().__init__(ctx)
        import torch

        from resihp_adapters.torch_native.data import Batches, job_source
        from resihp_adapters.torch_native.tp import TPEngine
        from resihp_adapters.torchkit.device import placement_for

        torch.set_num_threads(1)
        job = ctx.job
        c = parse_config(job.adapter_config, job.seed)
        if user is None and c["user"]:
            user = load_user(c["user"])
        if user is not None:
            model, recipe, data = user.stages, user.recipe, user.data(job.dp * job.num_microbatches)
        else:
            model, recipe = c["model"], None
            data = Batches(job_source(job, c["model"].vocab_size), c["model"].torch_dtype)
        self.engine = TPEngine(
            ctx.device, model, data, ctx.store, shard_degree=c["shard"], lr=c["lr"],
            weight_decay=c["weight_decay"], recipe=recipe, timeout_s=ctx.timeout_s,
            join_timeout_s=max(30.0, 6 * ctx.timeout_s),
            # torch's pipeline and FSDP send CUDA tensors themselves: GPUs only with NCCL
            placement=placement_for(ctx.device, job.adapter_config, own_transfers=False))
        self._watch = None
        self.engine.stretch = ctx.faults.stretch
        self.engine.delay_comm = ctx.faults.delay_comm
        if hasattr(ctx.faults, "flip_due"):  # the runtime's injector (tests may lend a stand-in)
            self.engine.flip_due, self.engine.corrupt = ctx.faults.flip_due, ctx.faults.corrupt
        self.engine.watch_grads = sdc_enabled(True)
        # the share of each parameter tensor a fingerprint reads, and in how many steps it
        # reads all of the optimizer state
        self._coverage, self._rounds = sdc_windows()
        self._windows = _FingerprintWindows()
        self._progress = (0, 0)
        # checkpoints written and sealed in the background (.async_checkpoint)
        self._writer = AsyncDcpWriter(generation=lambda: self.engine.generation)

    # ------------------------------------------------------------ placement
    @property
    def where(self) -> tuple[int, int, int] | None:
        pl = self.engine.place
        return None if pl is None else (pl.replica, pl.stage, pl.tp_index)

    def _check(self, plan: ParallelPlan) -> None:
        if self.engine.whole:
            from resihp_adapters.torch_native.loop import refuse_pipelined

            refuse_pipelined(plan.pp, max(len(g) for rep in plan.tp_groups for g in rep))
        if plan.num_layers != self.engine.model.n_layers:
            what = "adapter_config.model.n_layers" if self.engine.cfg is not None else "the model's blocks"
            raise ValueError(f"plan has {plan.num_layers} layers, {what}: {self.engine.model.n_layers}")
        self.engine.check(plan)

    # ------------------------------------------------------------ generations
    def rebuild_communicators(self, plan: ParallelPlan, generation: int, devices: list[int]) -> None:
        from resihp_adapters.torchkit.device import AbortWatch

        self._check(plan)
        self._stop_watch()
        self.engine.rebuild(plan, generation, devices)
        self._watch = AbortWatch(self.engine.placement, self.ctx.superseded).start()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def start_fresh(self, plan: ParallelPlan) -> None:
        self.engine.start_fresh()

    def check_move(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> None:
        self.engine.check_move(old_plan, new_plan, set(devices))

    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> int:
        return self.engine.move_state(old_plan, new_plan, set(devices), self.engine.iteration)

    def release(self) -> None:
        self._stop_watch()
        self.engine.release()

    def snapshot(self) -> None:
        self.engine.snapshot()

    def rollback(self) -> None:
        self.engine.rollback()

    def keep_snapshots(self, depth: int) -> bool:
        """Two-deep rollback (the worker's overlapped commit, docs/torch_native.md)."""
        self.engine.keep_snapshots(depth)
        return True

    def rollback_to(self, iteration: int) -> None:
        self.engine.rollback_to(iteration)

    def defer_steps(self, wanted: bool, *, fingerprints: bool) -> bool:
        """The optimizer step after the commit (the worker's :class:`~resihp_core.runtime.worker.DeferredStep`),
        where the worker ``wanted`` it, off the TP path, and unless the fingerprints
        compare exactly two replicas: a tie is re-executed from the state before the
        iteration that stepped, which only a rollback snapshot holds (docs/sdc.md)."""
        from resihp_adapters.torch_native.engine import live_replicas

        eng = self.engine
        pair = (fingerprints and eng.place is not None and eng.plan is not None
                and len(live_replicas(eng.plan)) // eng.place.shard_degree == 2)
        return eng.defer_steps(wanted and not pair)

    def apply_step(self) -> None:
        self.engine.apply_step()

    # ------------------------------------------------------------ iterations
    def run_iteration(self, program: Program, iteration: int) -> IterationResult:
        steps = iter(range(1 << 30))
        self.engine.before_action = lambda: self.ctx.step(iteration, next(steps))
        self.ctx.step(iteration, next(steps))
        return self.result_of(self.engine.run(program, iteration))

    def result_of(self, r: Any) -> IterationResult:
        """The core's result of an engine iteration (``run`` or the user's loop, :mod:`.loop`)."""
        stage = self.engine.place.stage
        iteration = r.iteration
        return IterationResult(  # the runtime's micro-batch k is (owner, mb) r.work[k]
            iteration=iteration, loss=r.loss,
            computed=[(stage, owner, j) for owner, j in r.work],
            forward_s={r.work[k]: t for k, t in r.forward_s.items()},
            backward_s={r.work[k]: t for k, t in r.backward_s.items()},
            iteration_s=r.iteration_s)

    def profile(self) -> IterationProfile | None:
        r, pl = self.engine.last, self.engine.place
        if r is None or pl is None:
            return None
        mbs = tuple(MicroBatchProfile(owner=r.work[k][0], mb=r.work[k][1], forward_s=f,
                                      backward_s=r.backward_s.get(k, 0.0), doc_lengths=r.lengths.get(k, ()))
                    for k, f in sorted(r.forward_s.items()))
        return IterationProfile(rank=self.ctx.device, device=self.ctx.device, generation=max(self.engine.generation, 0),
                                iteration=r.iteration, stage=pl.stage, replica=pl.replica, microbatches=mbs,
                                comm_s=0.0, iteration_s=r.iteration_s)

    # ------------------------------------------------------------ state
    def held_state(self) -> dict[str, Shard]:
        pl = self.engine.place
        if pl is None or self.engine.module is None:
            return {}
        return {name: Shard(h.tensors(), dim=0, index=pl.shard_index, parts=pl.shard_degree)
                for name, h in self.engine.local_shards().items()}

    def fingerprint(self) -> Fingerprint | None:
        """Checksum of this rank's local shards of every parameter and of this step's
        window of every optimizer-state tensor. Only HSDP (``shard`` below the live
        replicas) has devices holding the same shard: the same stage, layer range and
        shard index in different replicate groups; with plain FSDP2 (or TP, one replica)
        no one shares it: None."""
        import torch

        got = self._fingerprint_windows()
        if got is None:
            return None
        group, labels, views = got
        with torch.no_grad():
            return Fingerprint(group, seal(labels, [window_sum(v) for v in views]))

    def snapshot_fingerprint(self) -> Fingerprint | None:
        """The rollback snapshot of the state after this step (the next iteration's, so
        the worker takes no other) and :meth:`fingerprint` of that state, read during
        the copy: about a quarter of a fingerprint's separate pass (docs/sdc.md "What it
        costs")."""
        got = self._fingerprint_windows()
        if got is None:
            self.engine.snapshot()
            return None
        group, labels, views = got
        return Fingerprint(group, seal(labels, self.engine.snapshot(views)))

    def _fingerprint_windows(self) -> tuple[str, list[str], list[Tensor]] | None:
        """The fingerprint's group and what it reads (:func:`digest_windows`); None where
        no replica holds this rank's shard."""
        from resihp_adapters.torch_native.engine import live_replicas

        eng, pl = self.engine, self.engine.place
        if pl is None or eng.module is None or eng.plan is None:
            return None
        if len(live_replicas(eng.plan)) // pl.shard_degree < 2:
            return None
        labels, views = self._windows.get(eng, self._coverage, self._rounds)
        a, b = eng._layers(eng.plan, pl.stage)
        return (f"stage{pl.stage}/layers{a}-{b}/shard{pl.shard_index}of{pl.shard_degree}/"
                f"tp{pl.tp_index}of{pl.tp_degree}/step{eng.iteration}", labels, views)

    def sdc_signals(self) -> dict[str, float]:
        """The L2 norm of this rank's local reduced-gradient shards at its last step."""
        g = self.engine.grad_norm
        return {} if g is None else {"grad_norm": g}

    def full_state(self) -> dict[str, Any]:
        """This rank's share of the complete state by layout-independent names
        (:meth:`~.engine.TorchNativeEngine.flat_state`): parameters and sharded optimizer
        state as FSDP pieces (:class:`Shard`), the rest whole. No communication."""
        return self.engine.flat_state(gather=False)

    # ------------------------------------------------------------ checkpoints
    # The core's layout (docs/checkpoints.md): a DCP folder ``dcp/`` inside the
    # iteration's folder, written in the background by every checkpoint writer; once all
    # have written, the coordinator (writer rank 0) writes DCP's metadata, seals the
    # manifest and applies retention, as every adapter does.
    DCP_FOLDER = "dcp"

    def _path(self, iteration: int) -> str:
        from resihp_core import checkpoints

        if not self.ctx.job.checkpoint_dir:
            raise ValueError("torch_native checkpoints need job.checkpoint_dir")
        return str(checkpoints.iteration_dir(self.ctx.job.checkpoint_dir, iteration) / self.DCP_FOLDER)

    def save_checkpoint(self, iteration: int) -> None:
        """Off the training path: copy this rank's state into host buffers and queue
        the write (:mod:`.async_checkpoint`); the coordinator seals the checkpoint once
        every writer's files are written. The training thread waits only for the copy,
        for the generation's first plan (a collective: a peer that died raises here)
        and, if the previous write is still running, for that write. A storage error
        is reported through :meth:`checkpoint_status`, never raised."""
        if self.engine.module is None:
            return  # a standby: not in the executors' group
        t0 = time.perf_counter()
        if not self._writer.wait_idle():
            self._writer.give_up(iteration, f"the previous checkpoint write is still running after "
                                            f"{self._writer.busy_timeout_s:.0f} s")
            return
        staged = self.engine.stage_checkpoint()
        if staged is None:
            return  # an HSDP copy: replicate index 0 writes the same shards
        state, plan = staged
        job = self.ctx.job
        self._writer.submit(iteration, job.checkpoint_dir, self._path(iteration), state, plan,
                            job.checkpoint_keep, time.perf_counter() - t0)

    def checkpoint_status(self) -> list[CheckpointWrite]:
        return self._writer.results()

    def load_checkpoint(self, iteration: int, plan: ParallelPlan) -> None:
        """The state after ``iteration``, re-sharded by DCP onto ``plan``'s layout."""
        if iteration < 0:  # before the first committed iteration: the initial weights
            self.engine.start_fresh()
            return
        self.engine.load_checkpoint(self._path(iteration), iteration + 1)

    def close(self) -> None:
        """The job's end: the queued checkpoint writes finish first (the last
        checkpoint must be sealed before the process goes)."""
        self._writer.drain()
        self.engine.release()


class _FingerprintWindows:
    """What the fingerprint reads at each step (:func:`digest_windows` over the stage's
    parameters and optimizer state), planned once per layout: walking the module and
    the optimizer state and cutting the windows anew cost several ms per iteration on a
    small stage, about a tenth of a 60 ms DP step (docs/sdc.md "What it costs"). The
    windows rotate with the step (``turn``), so one plan is kept per phase of the
    rotation. A plan holds while the module, the optimizer, every parameter's local
    tensor and every optimizer-state tensor are the objects it was made of."""

    def __init__(self) -> None:
        self._owner: tuple[object, object] | None = None
        self._guard: list[tuple[object, object]] = []
        self._states: list[tuple[object, dict | None, tuple]] = []
        self._params: list[tuple[str, Tensor]] = []
        self._opt_state: list[tuple[str, Tensor]] = []
        self._phases: dict[tuple[int, int], tuple[list[str], list[Tensor]]] = {}

    def get(self, eng: TorchNativeEngine, share: float, rounds: int) -> tuple[list[str], list[Tensor]]:
        if not self._valid(eng):
            self._plan(eng)
        k = math.ceil(1.0 / share)
        phase = (eng.iteration % k, eng.iteration % rounds)
        got = self._phases.get(phase)
        if got is None:
            got = self._phases[phase] = digest_windows(self._params, share=share, turn=eng.iteration,
                                                       state=self._opt_state, rounds=rounds)
        return got

    def _valid(self, eng: TorchNativeEngine) -> bool:
        if self._owner is None or self._owner[0] is not eng.module or self._owner[1] is not eng.optimizer:
            return False
        for p, local in self._guard:
            if getattr(p, "_local_tensor", p) is not local:
                return False
        state = eng.optimizer.state
        for p, st, items in self._states:
            now = state.get(p)
            if now is not st or (st is not None and (len(st) != len(items)
                                                     or any(st.get(k) is not v for k, v in items))):
                return False
        return True

    def _plan(self, eng: TorchNativeEngine) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        # The DTensor's own local tensor (the same bits): ``detach().to_local()`` went
        # through DTensor dispatch twice per tensor, about half the fingerprint's CPU on
        # a 17-million-parameter stage (docs/benchmarks.md, "Where a fault-free iteration goes").
        local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
        self._params, self._opt_state, self._guard, self._states, self._phases = [], [], [], [], {}
        for name, p in eng.module.named_parameters():
            self._params.append((f"param.{name}", local(p)))
            self._guard.append((p, local(p)))
            st = eng.optimizer.state.get(p)  # none before the first step
            self._states.append((p, st, tuple(st.items()) if st is not None else ()))
            for k in sorted(st or ()):
                if isinstance(st[k], torch.Tensor):
                    self._opt_state.append((f"{k}.{name}", local(st[k])))
        self._owner = (eng.module, eng.optimizer)
