"""The user's own loop for data-parallel jobs (pp = 1; docs/torch_native.md, "Your loop").

An accelerate / FSDP2 user keeps the loop body: forward, loss and backward over the
micro-batches ResiHP hands this replica for the iteration, then one call,
:meth:`Iteration.step`, that reduces the gradients, clips, steps the optimizer and the
LR scheduler and commits::

    for it in trainer.iterations():          # one committed iteration each; reconfigures between
        with it:                             # a dead peer inside: rolled back, run again
            for batch in it.microbatches():  # this replica's share of the global batch
                loss = it.model(**batch).loss
                it.backward(loss)            # weighted: the step is the fault-free global batch's
            it.step()

Why a ``with`` block: a peer's death surfaces as an exception in whichever collective
(FSDP's all-gather in the forward, its reduce-scatter in the last backward) the user's
code is in; the block catches it, and the iteration is rolled back and run again under
the next plan (the worker runtime's restore / continue path, as ``train_batch()``).

Weighting. Replicas run uneven micro-batch counts (3 survivors of 4 share 8
micro-batches 3 / 3 / 2). ``backward(loss)`` takes ``loss`` as a mean over its
micro-batch (Hugging Face's ``outputs.loss``) and weighs it ``1 / G`` (``G``: the job's
global micro-batches); FSDP sums the gradients (divide factor 1), so every micro-batch
counts alike wherever it runs and the step equals the fault-free one. Gradients are
reduced once per iteration: FSDP's gradient sync runs only in the backward of this
replica's last micro-batch, and parameters stay gathered between micro-batches, so every
replica issues the same collectives whatever its count.

Pipelined jobs (pp > 1) keep ``train_batch()``: a schedule must drive the stages.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch
from torch import Tensor, nn

from resihp_core.errors import classify
from resihp_adapters.torchkit.device import ChunkTimer

if TYPE_CHECKING:
    from resihp_core.runtime.worker import Worker
    from resihp_adapters.torch_native.data import UserData
    from resihp_adapters.torch_native.engine import IterationResult, TorchNativeEngine

__all__ = ["Iteration", "LoopBackend", "ResilientLoop", "StockLoop", "iterations", "refuse_pipelined"]


def refuse_pipelined(pp: int, tp: int = 1) -> None:
    """The loop mode is for data-parallel jobs; pipelined / TP jobs are refused up front."""
    if pp != 1 or tp != 1:
        raise ValueError(f"trainer.iterations() (your own loop) runs data-parallel jobs only (parallel.pp = 1, tp = 1); "
                         f"this job has pp = {pp}, tp = {tp}: a schedule must drive pipeline stages, so call "
                         "trainer.train_batch() (docs/torch_native.md, 'Your loop')")


class LoopBackend(Protocol):
    """What an :class:`Iteration` runs on: the resilient engine under ``resihp launch``
    (:class:`ResilientLoop`) or plain FSDP2 (``reference.StockLoop``)."""

    index: int  # the iteration
    resilient: bool  # a failure inside the block is survived (rolled back, run again)
    work: list[tuple[int, int]]  # (owner replica, micro-batch) this replica runs, in order
    global_microbatches: int

    @property
    def module(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def lr_scheduler(self) -> object | None: ...

    def batch(self, owner: int, mb: int) -> Any: ...

    def before(self, k: int) -> None: ...  # before micro-batch k (abort checks, beats)

    def lengths(self, owner: int, mb: int) -> tuple[int, ...]: ...  # its document lengths, for the profiles

    def timer(self) -> ChunkTimer: ...  # times a forward or backward for the profiles

    def timed(self, seconds: float) -> float: ...  # injected slowdowns

    def step(self, result: IterationResult) -> float | None: ...  # clip, optimizer, scheduler, commit


def set_last_backward(module: nn.Module, last: bool) -> None:
    """FSDP2: reduce (and reshard) only in the last backward of the iteration."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.set_is_last_backward(last)
        module.set_reshard_after_backward(last)
        module.set_requires_gradient_sync(last)


class Iteration:
    """One iteration of the user's loop (see the module docstring)."""

    def __init__(self, backend: LoopBackend) -> None:
        from resihp_adapters.torch_native.engine import IterationResult

        self._b = backend
        self.index = backend.index
        self._result = IterationResult(backend.index, work=list(backend.work))
        self._k = -1  # the micro-batch being run
        self._t = 0.0
        self._backwards = 0
        self._entered = False
        self._stepped = False
        self.loss: float | None = None  # this replica's share of the global loss, once committed
        self.committed = False
        self.failed: str | None = None  # why the iteration was given up (a peer died)

    # ------------------------------------------------------------ what the body uses
    @property
    def model(self) -> nn.Module:
        """This generation's model: the user's module (its own ``forward``), FSDP-wrapped.
        Take it from the iteration each time: a reconfiguration builds it anew."""
        return self._b.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._b.optimizer

    @property
    def lr_scheduler(self) -> object | None:
        return self._b.lr_scheduler

    @property
    def weight(self) -> float:
        """A micro-batch's weight in the global batch: ``1 / G``."""
        return 1.0 / self._b.global_microbatches

    def microbatches(self) -> Iterator[Any]:
        """This replica's micro-batches of the iteration, as the user's ``collate_fn``
        made them (global micro-batch ``owner * m + mb``: the fault-free batch whoever
        runs it). Each must be followed by one :meth:`backward`."""
        if not self._entered:
            raise RuntimeError("run the iteration inside `with it:` (a failure inside is rolled back and retried)")
        for k, (owner, mb) in enumerate(self._b.work):
            if self._backwards != k:
                raise RuntimeError(f"micro-batch {k - 1}: call it.backward(loss) once per micro-batch")
            self._b.before(k)
            self._k = k
            batch = self._b.batch(owner, mb)
            # The Detector's cost model is fitted on each micro-batch's document lengths:
            # without them it never leaves its warm-up (no slow device is ever found).
            self._result.lengths[k] = self._b.lengths(owner, mb)
            self._timer = self._b.timer().start()
            yield batch
        if self._backwards != len(self._b.work):
            raise RuntimeError("the last micro-batch: call it.backward(loss) once per micro-batch")

    def backward(self, loss: Tensor, *, weight: float | None = None) -> None:
        """``(loss * weight).backward()`` with FSDP's reduction on the last micro-batch only.
        ``loss``: a mean over the micro-batch; ``weight``: default :attr:`weight` (pass your
        own for another normalisation; it must be the same for any layout)."""
        k = self._k
        if k < 0 or self._backwards != k:
            raise RuntimeError("it.backward(loss): once per micro-batch of it.microbatches()")
        r = self._result
        r.forward_s[k] = self._b.timed(self._timer.stop())
        timer = self._b.timer().start()
        scaled = loss * (self.weight if weight is None else weight)
        set_last_backward(self._b.module, k == len(self._b.work) - 1)
        scaled.backward()
        r.backward_s[k] = self._b.timed(timer.stop())
        r.loss += float(scaled.detach())
        self._backwards += 1

    def step(self) -> float | None:
        """Reduce (done by the last backward), clip, optimizer and LR scheduler step,
        commit. Returns this replica's share of the global loss once the iteration
        committed on every live rank, else None (it is run again)."""
        if self._backwards != len(self._b.work) or not self._b.work:
            raise RuntimeError(f"it.step() after {self._backwards} of {len(self._b.work)} micro-batches: "
                               "run every micro-batch of it.microbatches() first")
        if self._stepped:
            raise RuntimeError("it.step() twice in one iteration")
        self._stepped = True
        self._result.iteration_s = time.perf_counter() - self._t0
        loss = self._b.step(self._result)
        self.committed = loss is not None
        self.loss = loss
        return loss

    # ------------------------------------------------------------ the with block
    def __enter__(self) -> Iteration:
        self._entered = True
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, et: type | None, ev: BaseException | None, tb: object) -> bool:
        if ev is None:
            if not self._stepped:
                raise RuntimeError("the iteration's block ended without it.step()")
            return False
        if not self.committed and self._b.resilient and classify(ev) == "device":
            # A collective failed (a dead peer, a superseded generation). Only the text
            # is kept: a live traceback would pin the broken groups' sockets.
            self.failed = f"{type(ev).__name__}: {ev}"
            return True
        return False  # a bug in the loop body: the script fails as it would without ResiHP


class ResilientLoop:
    """:class:`LoopBackend` on the engine, under the worker runtime: the same snapshot,
    rollback, checkpoint, report and commit as ``train_batch()`` (``Worker.begin_iteration`` /
    ``end_iteration`` / ``abandon_iteration``)."""

    resilient = True

    def __init__(self, worker: Worker, engine: TorchNativeEngine, data: UserData,
                 to_result: Callable[[IterationResult], Any]) -> None:
        self.worker, self.engine, self.data, self._to_result = worker, engine, data, to_result
        self.index = worker.begin_iteration()
        plan, place = engine.plan, engine.place
        self.work = list(plan.work(place.replica, 0))
        self.m = plan.num_microbatches
        self.global_microbatches = data.global_microbatches
        self._steps = iter(range(1 << 30))
        engine.optimizer.zero_grad(set_to_none=True)

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> object | None:
        return self.engine.scheduler

    def batch(self, owner: int, mb: int) -> Any:
        return _to_home(self.data.collated(self.index, owner * self.m + mb), self.engine.placement.to_home)

    def lengths(self, owner: int, mb: int) -> tuple[int, ...]:
        return self.data.micro_batch(self.index, owner, mb, self.m).lengths

    def timer(self) -> ChunkTimer:
        """On the host, busy time (:class:`~.tp.BusyTimer`): the last backward holds
        FSDP's reduce-scatter, where every peer of a slow replica waits for it; wall time
        would show them all as slow as it (its own compute is what the Detector compares)."""
        if self.engine.placement.device.type == "cpu":
            from resihp_adapters.torch_native.tp import BusyTimer

            return BusyTimer()
        return self.engine.chunk_timer()

    def before(self, k: int) -> None:
        self.worker.ctx.step(self.index, next(self._steps))  # beats; raises once superseded
        if k == len(self.work) - 1:
            self.engine.delay_comm()  # injected: before the reduction

    def timed(self, seconds: float) -> float:
        return self.engine.stretch(seconds)

    def step(self, result: IterationResult) -> float | None:
        e = self.engine
        self.worker.ctx.step(self.index, next(self._steps))
        e.finish_grads()
        e.inject_flip("grad")  # injected silent data corruption, when due (docs/sdc.md)
        e.step_optimizer()
        e.inject_flip("param")
        e.inject_flip("optimizer")
        if e.scheduler is not None:
            e.scheduler.step()
        e.optimizer.zero_grad(set_to_none=True)
        e.iteration = self.index + 1
        e.last = result
        done = self.worker.end_iteration(self._to_result(result))
        return None if done is None else result.loss


def iterations(worker: Worker, engine: TorchNativeEngine, data: UserData,
               to_result: Callable[[IterationResult], Any]) -> Iterator[Iteration]:
    """The resilient loop: one :class:`Iteration` per attempt until the job ends. An
    attempt that failed inside its ``with`` block is given up here (rollback, leave the
    generation), after the block, and the same iteration comes again under the next plan."""
    while worker.next_iteration() is not None:
        it = Iteration(ResilientLoop(worker, engine, data, to_result))
        yield it
        if it.failed is not None:
            worker.abandon_iteration(it.failed)
        elif not it._stepped:
            raise RuntimeError("trainer.iterations(): each iteration runs inside `with it:` and ends with it.step()")


def _to_home(b: Any, home: Callable[[Tensor], Tensor]) -> Any:
    """A collated batch's tensors on the training device."""
    if isinstance(b, dict):
        return {k: home(v) if isinstance(v, Tensor) else v for k, v in b.items()}
    if isinstance(b, (tuple, list)):
        return type(b)(home(v) if isinstance(v, Tensor) else v for v in b)
    return home(b) if isinstance(b, Tensor) else b


class StockLoop:
    """The user's loop without ResiHP (plain ``accelerate launch`` / ``torchrun``): the
    whole model with ``fully_shard`` over the default group (HSDP when ``shard`` is a
    smaller divisor), rank ``r`` runs global micro-batches ``r * m .. r * m + m - 1``,
    the same weighting and global clipping; nothing survives a failure."""

    resilient = False

    def __init__(self, stages: Any, recipe: Any, data: UserData, *, num_microbatches: int, shard: int,
                 iterations: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from resihp_adapters.torch_native.engine import shard_degree_for

        world, rank = dist.get_world_size(), dist.get_rank()
        k = shard_degree_for(world, shard)
        mesh = init_device_mesh("cpu", (world // k, k), mesh_dim_names=("dp_replicate", "dp_shard"))
        module = stages.build_whole()
        blocks = stages.blocks(module)
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        for m in (*blocks, module):
            m.set_gradient_divide_factor(1.0)  # sums: backward() carries the global weight
            m.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
        self.stages, self.recipe, self.data = stages, recipe, data
        self._module = module
        self._optimizer = recipe.optimizer(list(module.parameters()))
        self._scheduler = recipe.lr_scheduler(self._optimizer) if recipe.lr_scheduler else None
        self.copies, self.iterations = world // k, iterations
        self.m, self.global_microbatches = num_microbatches, data.global_microbatches
        self.work = [(rank, j) for j in range(num_microbatches)]
        self.index = 0

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def lr_scheduler(self) -> object | None:
        return self._scheduler

    def batch(self, owner: int, mb: int) -> Any:
        return self.data.collated(self.index, owner * self.m + mb)

    def lengths(self, owner: int, mb: int) -> tuple[int, ...]:
        return ()  # nobody reads profiles on a plain launch

    def timer(self) -> ChunkTimer:
        return ChunkTimer(torch.device("cpu"))

    def before(self, k: int) -> None:
        pass

    def timed(self, seconds: float) -> float:
        return seconds

    def step(self, result: IterationResult) -> float | None:
        from resihp_adapters.torch_native.engine import clip_global

        if self.recipe.max_grad_norm is not None:
            clip_global(self._module, self.stages.aliases, self.recipe.max_grad_norm, None, self.copies)
        self._optimizer.step()
        if self._scheduler is not None:
            self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        self.index += 1
        return result.loss

    def run(self) -> Iterator[Iteration]:
        while self.index < self.iterations:
            it = Iteration(self)
            yield it
            if not it._stepped:
                raise RuntimeError("trainer.iterations(): each iteration runs inside `with it:` and ends with it.step()")

    def flat_state(self) -> dict[str, object]:
        """The complete state by the engine's names (collective over the ranks)."""
        from resihp_adapters.torch_native.engine import Held, flatten_state

        full: dict[str, Held] = {}
        for name, p in self._module.named_parameters():
            h = Held(p.full_tensor().detach().clone())
            for key, v in self._optimizer.state.get(p, {}).items():
                if hasattr(v, "full_tensor"):
                    h.sharded[key] = v.full_tensor().clone()
                else:
                    h.other[key] = v.detach().clone() if isinstance(v, Tensor) else v
            full.setdefault(self.stages.aliases.get(name, name), h)
        return flatten_state(full, self._optimizer, self._scheduler, self.index)
