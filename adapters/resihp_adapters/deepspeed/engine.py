"""ResiHP's DeepSpeed pipeline engine: the core's programs run as DeepSpeed instructions.

:class:`ResiPipelineEngine` is a real :class:`deepspeed.runtime.pipe.engine.PipelineEngine`
(forward, backward, loss scaling, DP gradient reduction and the optimizer step are
DeepSpeed's own code). Like DeepSpeed's ``DualPipeVEngine`` it only replaces the
schedule (``_train_schedule``) and extends ``_INSTRUCTION_MAP``:

* the schedule is *lowered* from the core's per-executor :class:`~resihp_core.program.Program`
  (:func:`lower_program`), so the order of forward/backward work is exactly what the
  Scheduler judged;
* point-to-point goes to explicit global ranks (the peer replica of each primitive), so a
  micro-batch of another replica can run on this replica's stage (migrated work);
* every buffer keeps its own loss and output gradient (the stock engine keeps one of
  each, which is only right for the stock 1F1B order);
* micro-batches are loaded by address (iteration, owner replica, micro-batch) from a
  :class:`~resihp_adapters.deepspeed.data.MicroBatchSource`, never from a shared iterator;
* a :class:`CommitPoint` instruction runs before the optimizer step: pending sends are
  completed and the engine's ``commit_hook`` decides whether the step may happen (the
  runtime's commit barrier); nothing in the model changes before it, so an iteration
  abandoned there is rolled back by zeroing gradients.

Loss scaling stays DeepSpeed's: each micro-batch loss is divided by the configured
``gradient_accumulation_steps``, which is the plan's *nominal* micro-batch count per
replica, so uneven counts per replica (migrated work) still give the exact mean gradient
after DeepSpeed's DP average. See ``docs/deepspeed.md``.
"""

from __future__ import annotations

import time
from types import MethodType
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as tdist
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                             PipelineParallelGrid)

from resihp_core.plan import Migration, ParallelPlan
from resihp_adapters.torchkit.device import ChunkTimer
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

__all__ = [
    "ResiPipelineModule",
    "ResiPipelineEngine",
    "LoadAddressed",
    "SendActivationTo",
    "RecvActivationFrom",
    "SendGradTo",
    "RecvGradFrom",
    "CommitPoint",
    "LoweredSchedule",
    "lower_program",
    "rank_of",
    "device_rank",
    "live_replicas",
    "whole_replicas",
    "present_replicas",
    "is_partial",
    "partial_runnable",
    "PartialTopology",
    "PartialGrid",
    "plan_topology",
    "IterationAborted",
    "retire_groups",
    "reap_retired",
]


# ----------------------------------------------------------------- the module

#: How long one point-to-point transfer may wait for its peer (set to the job's
#: ``timeout_s`` by :func:`~resihp_adapters.deepspeed.world.bound_op_timeouts`). gloo's
#: blocking send/recv otherwise use the timeout the world was *created* with (the long
#: join timeout), so a survivor blocked on a peer that left its generation cleanly would
#: wait that long instead of failing fast.
P2P_TIMEOUT_S = 60.0


#: Whether this rank's plan generation was superseded (set per generation by the
#: adapter): a wait on a peer then gives up at once (:func:`p2p_wait`).
SUPERSEDED: Callable[[], bool] | None = None


def p2p_wait(work: Any) -> None:
    """Wait for a send/recv, at most :data:`P2P_TIMEOUT_S` (then raise), and raise
    :class:`~resihp_core.adapter.GenerationAborted` as soon as the generation is
    superseded (:data:`SUPERSEDED`).

    A peer that left a superseded generation can keep its end of the connection open
    (its groups outlive the generation while a reference remains), and gloo's blocking
    wait cannot be interrupted or polled: the survivor waiting on it would sit out the
    whole op timeout (measured: 2 of 5 kills took 11 s instead of 1.5 s). So the wait
    runs in a helper thread while this one watches the generation; an abandoned wait
    ends by itself within the op timeout (docs/deepspeed.md, timeouts)."""
    from datetime import timedelta

    timeout = timedelta(seconds=P2P_TIMEOUT_S)
    check = SUPERSEDED
    if check is None:
        work.wait(timeout=timeout)
        return
    import threading

    done, error = threading.Event(), []

    def wait() -> None:
        try:
            work.wait(timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            error.append(e)
        finally:
            done.set()

    waiter = threading.Thread(target=wait, daemon=True, name="resihp-p2p-wait")
    waiter.start()
    while not done.wait(0.02):
        if check():
            from resihp_core.adapter import GenerationAborted

            ABANDONED.append(waiter)
            raise GenerationAborted("the plan generation was superseded while waiting on a peer")
    if error:
        raise error[0]


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """``torch.distributed.all_gather_object`` whose waits give up once the generation
    is superseded (:func:`p2p_wait`): torch's own blocks until the op timeout when a
    peer left the generation instead of joining the gather."""
    from resihp_adapters.deepspeed.state import pack, unpack

    payload = pack(obj)
    n = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(tdist.get_world_size(group=group))]
    p2p_wait(tdist.all_gather(sizes, n, group=group, async_op=True))
    width = max(int(x) for x in sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    out = [torch.empty(width, dtype=torch.uint8) for _ in sizes]
    p2p_wait(tdist.all_gather(out, padded, group=group, async_op=True))
    return [unpack(t[: int(k)]) for t, k in zip(out, sizes)]


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
    """``torch.distributed.all_reduce`` whose wait gives up once the generation is
    superseded (:func:`p2p_wait`)."""
    work = tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM if op is None else op, group=group, async_op=True)
    p2p_wait(work)


#: DeepSpeed's ``TorchBackend`` collectives and where ``async_op`` sits in their
#: positional arguments (``self`` first); its wrappers hide the signatures.
_COLLECTIVES = {"all_reduce": 4, "broadcast": 4, "all_gather": 4, "all_gather_into_tensor": 4,
                "reduce_scatter_tensor": 5}


def bound_collectives() -> None:
    """Make DeepSpeed's blocking collectives (its ``TorchBackend``: the data-parallel,
    tied and ZeRO reductions, gathers and broadcasts) wait through :func:`p2p_wait`, so
    they also give up once the generation is superseded. Process-wide, idempotent."""
    import functools

    from deepspeed.comm.torch import TorchBackend

    for name, pos in _COLLECTIVES.items():
        orig = getattr(TorchBackend, name, None)
        if orig is None or getattr(orig, "_resihp_bounded", False):
            continue

        def make(orig: Any = orig, pos: int = pos) -> Any:
            @functools.wraps(orig)
            def call(*args: Any, **kwargs: Any) -> Any:
                positional = len(args) > pos
                if SUPERSEDED is None or (args[pos] if positional else kwargs.get("async_op", False)):
                    return orig(*args, **kwargs)
                if positional:
                    args = (*args[:pos], True, *args[pos + 1:])
                else:
                    kwargs["async_op"] = True
                work = orig(*args, **kwargs)
                if work is not None:
                    p2p_wait(work)
                return None

            call._resihp_bounded = True  # type: ignore[attr-defined]
            return call

        setattr(TorchBackend, name, make())


class unbounded:
    """Waits inside this block do not give up when the generation is superseded: for
    the user's own collective calls (``full_state``, ``eval_batch``, DeepSpeed-format
    checkpoints), which a script also makes after the job's stop (the stop supersedes
    the last generation, and every rank must still finish the call)."""

    def __enter__(self) -> unbounded:
        global SUPERSEDED
        self._saved, SUPERSEDED = SUPERSEDED, None
        return self

    def __exit__(self, *exc: object) -> None:
        global SUPERSEDED
        SUPERSEDED = self._saved


#: Waits given up on (:func:`p2p_wait`), still blocked in gloo until the op timeout.
ABANDONED: list[Any] = []


def join_abandoned() -> None:
    """Before the process ends: let every abandoned wait finish (at most the op timeout).
    A thread still inside gloo while the interpreter shuts down aborts the process
    ("terminate called without an active exception")."""
    while ABANDONED:
        ABANDONED.pop().join(timeout=P2P_TIMEOUT_S + 5.0)
    reap_retired()


#: Process groups of ended generations kept alive while a wait abandoned in them
#: (:func:`p2p_wait`) may still run: (groups, the abandoned waits of that moment).
RETIRED: list[tuple[list[Any], list[Any]]] = []


def retire_groups(groups: list[Any]) -> None:
    """Keep ``groups`` (an ending generation's) referenced while any abandoned wait
    runs. Dropping the last reference to a gloo group runs its destructor, which joins
    the group's worker threads with the GIL held: a collective still blocked there on
    a peer that left (an abandoned DP or tied reduction) held the whole process, the
    next generation's join included, for the rest of the op timeout (~10 s after one
    kill in eight). Released by :func:`reap_retired` once those waits have ended."""
    pending = [t for t in ABANDONED if t.is_alive()]
    if pending:
        RETIRED.append((list(groups), pending))


def reap_retired() -> None:
    """Drop the retired groups whose abandoned waits have all ended (their worker
    threads are idle again, so the destructors return at once)."""
    RETIRED[:] = [(g, w) for g, w in RETIRED if any(t.is_alive() for t in w)]
    ABANDONED[:] = [t for t in ABANDONED if t.is_alive()]

def seed_layer(seed: int) -> None:
    """DeepSpeed's ``set_random_seed`` (Python's ``random``, NumPy's, torch's), which a
    ``PipelineModule`` with ``seed_layers`` calls once per layer per micro-batch, with
    the same generator states, but without a formatted stack per call:
    ``torch.manual_seed`` queues the seeding of every accelerator that is not started
    (CUDA on a CPU host, XPU, MTIA) together with the caller's formatted stack, which
    under the worker's deeper stack cost more than a layer's forward on the smallest
    models (docs/deepspeed.md). Before CUDA starts on a CUDA host it defers to
    ``torch.manual_seed`` (CUDA then starts with the seed it would have had); once CUDA
    runs, it seeds CUDA's generators directly, as torch does then."""
    import random

    import numpy

    random.seed(seed)
    numpy.random.seed(seed % 2**32)  # the ranges DeepSpeed's own function reduces to
    seed = int(seed) % 2**63
    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        torch.manual_seed(seed)
        return
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


class ResiPipelineModule(PipelineModule):
    """A :class:`PipelineModule` cut at explicit layer boundaries.

    ``parts`` is ``[0, b1, ..., num_layers]`` (DeepSpeed's own ``parts`` format): stage
    ``s`` holds layers ``parts[s]:parts[s+1]``. DeepSpeed's ``partition_method`` only
    knows uniform/parameters/type; a ResiHP plan's layer ranges are arbitrary, so
    ``_partition_layers`` is overridden (as DeepSpeed's DualPipeV module does).
    """

    def __init__(self, layers: Sequence[Any], *, parts: Sequence[int], count_build: bool = False,
                 **kwargs: Any) -> None:
        """``count_build``: build every ``LayerSpec`` once before this stage's layers, as
        DeepSpeed's ``partition_method="parameters"`` does to count parameters, so an
        unseeded build (``seed_layers=False``) draws the process's random numbers as
        plain DeepSpeed's module would (the job's first generation)."""
        parts = [int(p) for p in parts]
        self._count_build = bool(count_build)
        n = len(list(layers))
        if not parts or parts[0] != 0 or parts[-1] != n or any(b <= a for a, b in zip(parts, parts[1:])):
            raise ValueError(
                f"parts must rise strictly from 0 to the number of layers ({n}), got {parts}"
            )
        self._explicit_parts = parts
        if kwargs.get("seed_layers") and kwargs.get("seed_fn") is None:
            kwargs["seed_fn"] = seed_layer  # the same seeds, cheaper (:func:`seed_layer`)
        import deepspeed.runtime.pipe.module as ds_module

        partial = isinstance(kwargs.get("topology"), PartialTopology)
        stock = ds_module.PipelineParallelGrid
        if partial:
            ds_module.PipelineParallelGrid = PartialGrid  # the grid class the module builds
        try:
            super().__init__(layers, **kwargs)
        finally:
            ds_module.PipelineParallelGrid = stock
        if len(parts) - 1 != self.num_stages:
            raise ValueError(f"parts {parts} give {len(parts) - 1} stages, topology has {self.num_stages}")

    def _partition_layers(self, method: str = "uniform") -> None:
        if self._count_build:
            from deepspeed.pipe import LayerSpec

            for spec in self._layer_specs:
                if isinstance(spec, LayerSpec):
                    spec.build()  # discarded: the random numbers DeepSpeed's counting draws
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self.parts = list(self._explicit_parts)
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def _index_tied_modules(self) -> dict[str, dict[str, Any]]:
        """DeepSpeed's tie groups, per replica. On a :class:`PartialTopology` a replica may
        miss the stage of some tied layers, so there is one group per tie key over every
        rank holding a copy, in every replica: its all-reduce sums every copy's gradient
        (the whole batch's), and the data-parallel reduction leaves tied weights alone
        (:meth:`ResiPipelineEngine._exec_reduce`)."""
        if not isinstance(self._topo, PartialTopology):
            return super()._index_tied_modules()
        from deepspeed import comm as ds_dist
        from deepspeed.pipe import TiedLayerSpec

        specs = self._layer_specs
        out: dict[str, dict[str, Any]] = {}
        for key in sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)}):
            stages = {self.stage_owner(i) for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and s.key == key}
            ranks = sorted(r for c, r in self._topo.mapping.items() if c.pipe in stages)
            group = ds_dist.new_group(ranks=ranks)  # every rank creates every group, in one order
            if self.global_rank in ranks:
                out[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                            "module": self.tied_modules[key]}
                if self.global_rank != ranks[0]:
                    for p in self.tied_modules[key].parameters():
                        p.ds_pipe_replicated = True
        return out

    def local_layers(self) -> dict[int, torch.nn.Module]:
        """Global layer index -> module, for the layers with parameters this rank holds."""
        out = {}
        for idx in range(self._local_start, self._local_stop):
            mod = getattr(self, str(idx), None)
            if isinstance(mod, torch.nn.Module):
                out[idx] = mod
        return out


# --------------------------------------------------------- plan <-> DeepSpeed grid
def present_replicas(plan: ParallelPlan) -> list[int]:
    """The plan's replicas that hold devices on at least one stage, in order (DeepSpeed's
    data-parallel indices); one TP degree throughout."""
    out, degrees = [], set()
    for r, rep in enumerate(plan.tp_groups):
        if any(rep):
            out.append(r)
            degrees.update(len(g) for g in rep if g)
    if len(degrees) != 1:
        raise ValueError(f"the DeepSpeed adapter runs one TP degree, plan has {sorted(degrees) or 'no devices'}")
    return out


def is_partial(plan: ParallelPlan) -> bool:
    """Whether some replica keeps only part of its stages (the rest of its work migrated)."""
    return any(any(rep) and not all(rep) for rep in plan.tp_groups)


def live_replicas(plan: ParallelPlan) -> list[int]:
    """The plan's replicas that hold devices, in order. Without partial replicas
    DeepSpeed's grid is a full pp x dp x tp box; a replica is either whole or gone.
    A partial replica is only allowed in a plan run on a :class:`PartialTopology`."""
    if is_partial(plan) and not partial_runnable(plan):
        r = next(r for r, rep in enumerate(plan.tp_groups) if any(rep) and not all(rep))
        raise ValueError(
            f"replica {r} keeps only some of its stages: this configuration runs whole replicas "
            "(see whole_replicas and docs/deepspeed.md, partial replicas)"
        )
    return present_replicas(plan)


def partial_runnable(plan: ParallelPlan) -> bool:
    """A partial-replica plan the engine runs as it is (TP degree 1, more than one
    stage); see :class:`PartialTopology`."""
    return plan.pp > 1 and all(len(g) <= 1 for rep in plan.tp_groups for g in rep)


def whole_replicas(plan: ParallelPlan) -> ParallelPlan:
    """The equivalent plan DeepSpeed can run: a replica that keeps only some of its
    stages (the others' work migrated) is left out entirely, and every piece of work it
    executed moves to the first whole replica. The same (stage, micro-batch) pieces run
    exactly once on the same data, so training is unchanged; the left-out devices idle.
    Plans without partial replicas come back unchanged."""
    partial, whole = [], []
    for r, rep in enumerate(plan.tp_groups):
        n = sum(1 for g in rep if g)
        (whole if n == len(rep) else partial if n else []).append(r)
    if not partial:
        return plan
    if not whole:
        raise ValueError(f"plan generation {plan.generation} has no replica holding every stage: "
                         "the DeepSpeed adapter cannot run it")
    target = whole[0]
    execs = plan.executor_map()
    moves = []
    for (s, o, j), r in sorted(execs.items()):
        if r in partial:
            r = target
        if r != o:
            moves.append(Migration(s, o, j, r))
    groups = tuple(tuple(() for _ in rep) if r in partial else rep for r, rep in enumerate(plan.tp_groups))
    idle = tuple(d for r in partial for g in plan.tp_groups[r] for d in g)
    return plan.with_(tp_groups=groups, migrations=tuple(moves), standbys=tuple(plan.standbys) + idle)


def _coords(plan: ParallelPlan) -> list[tuple[int, int]]:
    """(stage, DeepSpeed data index) of every executor, in rank order (stage-major, as
    DeepSpeed's ``PipeDataParallelTopology``)."""
    present = present_replicas(plan)
    return [(s, k) for s in range(plan.pp) for k, r in enumerate(present) if plan.tp_groups[r][s]]


class PartialTopology(PipeDataParallelTopology):
    """DeepSpeed's pipe x data topology with holes: the coordinates of a replica's lost
    stages have no rank, and the others are numbered in DeepSpeed's order without them.
    Communicator lists along an axis leave the holes out (a stage's data-parallel group
    has only its present replicas). Only for TP degree 1 (``docs/deepspeed.md``,
    partial replicas)."""

    def __init__(self, num_pp: int, num_dp: int, present: Sequence[tuple[int, int]]) -> None:
        super().__init__(num_pp=num_pp, num_dp=num_dp)
        self.mapping = {self.ProcessCoord(pipe=p, data=d): i for i, (p, d) in enumerate(present)}

    def get_rank(self, **coord: int) -> int | None:  # type: ignore[override]
        """The rank at a coordinate, None at a hole."""
        return self.mapping.get(self.ProcessCoord(**coord))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        if axis not in self.axes:
            return []
        other = [a for a in self.axes if a != axis]
        lists: dict[tuple[int, ...], list[int]] = {}
        for coord, rank in sorted(self.mapping.items(), key=lambda kv: kv[1]):
            lists.setdefault(tuple(getattr(coord, a) for a in other), []).append(rank)
        return [sorted(v) for _, v in sorted(lists.items())]


class PartialGrid(PipelineParallelGrid):
    """DeepSpeed's grid over a :class:`PartialTopology`: the world is the present ranks,
    not the box, and a stage outside this rank's replica may have no rank there
    (``stage_to_global`` gives None; the engine never sends to it: its point-to-point
    peers come from the program)."""

    def _is_grid_valid(self) -> bool:
        return self._topo.world_size() == tdist.get_world_size()

    def _build_p2p_groups(self) -> list[list[int]]:
        return []  # DeepSpeed builds p2p groups only without send/recv support (old torch)


def plan_topology(plan: ParallelPlan):
    """DeepSpeed's topology for the plan's replicas. Its rank order (pipe, data,
    model) is the order :func:`rank_of` gives, so ``grid.stage_to_global`` agrees.
    A plan with partial replicas gets a :class:`PartialTopology`."""
    dp = len(live_replicas(plan))
    if is_partial(plan):
        return PartialTopology(plan.pp, dp, _coords(plan))
    tp = plan.degree(live_replicas(plan)[0], 0)
    if tp == 1:
        return PipeDataParallelTopology(num_pp=plan.pp, num_dp=dp)
    return PipeModelDataParallelTopology(num_pp=plan.pp, num_mp=tp, num_dp=dp)


def ds_replica(plan: ParallelPlan, replica: int) -> int:
    """DeepSpeed's data-parallel index of plan replica ``replica``."""
    live = live_replicas(plan)
    if replica not in live:
        raise ValueError(f"replica {replica} has no devices in plan generation {plan.generation}")
    return live.index(replica)


def rank_of(plan: ParallelPlan, replica: int, stage: int, tp_index: int = 0) -> int:
    """Global rank of (replica, stage, TP index) in the plan generation's world."""
    if is_partial(plan):
        return _coords(plan).index((stage, ds_replica(plan, replica)))
    dp = len(live_replicas(plan))
    tp = plan.degree(replica, stage)
    return (stage * dp + ds_replica(plan, replica)) * tp + tp_index


def device_rank(plan: ParallelPlan, device: int) -> int:
    """Global rank of ``device`` in the plan generation's world."""
    loc = plan.location(device)
    if loc is None:
        raise ValueError(f"device {device} runs nothing in plan generation {plan.generation}")
    return rank_of(plan, *loc)


def world_size(plan: ParallelPlan) -> int:
    return len(plan.devices())


# ----------------------------------------------------------------- instructions
class LoadAddressed(ds_schedule.BufferOpInstruction):
    """Load micro-batch (owner replica, mb) of the current iteration into a buffer."""


class SendActivationTo(ds_schedule.BufferOpInstruction):
    """Send a buffer's stage output to global rank ``peer``."""


class RecvActivationFrom(ds_schedule.BufferOpInstruction):
    """Receive a buffer's stage input from global rank ``peer``."""


class SendGradTo(ds_schedule.BufferOpInstruction):
    """Send a buffer's input gradient to global rank ``peer``."""


class RecvGradFrom(ds_schedule.BufferOpInstruction):
    """Receive a buffer's output gradient from global rank ``peer``."""


class CommitPoint(ds_schedule.PipeInstruction):
    """Before the optimizer step: finish sends, then ask the runtime to commit."""


@dataclass
class LoweredSchedule:
    """A program lowered to DeepSpeed instructions, in the shape ``_exec_schedule`` wants
    (an iterable of steps, each a list of instructions, and a buffer count)."""

    steps: list[list[ds_schedule.PipeInstruction]]
    buffers: dict[tuple[int, int], int] = field(default_factory=dict)

    def num_pipe_buffers(self) -> int:
        return max(1, len(self.buffers))

    def __iter__(self):
        return iter(self.steps)

    def instructions(self) -> list[ds_schedule.PipeInstruction]:
        return [c for step in self.steps for c in step]


def lower_program(program: Program, plan: ParallelPlan, tp_index: int = 0) -> LoweredSchedule:
    """Lower one executor's program into DeepSpeed instructions, one instruction per step.

    Each (owner, mb) gets its own buffer; point-to-point primitives name the peer
    *replica*, which becomes the peer's global rank (same TP index). ``ReduceGrads``
    becomes DeepSpeed's tied-weight then DP reduction; a :class:`CommitPoint` precedes
    ``OptimizerStep``."""
    s = program.stage
    buffers: dict[tuple[int, int], int] = {}

    def buf(owner: int, mb: int) -> int:
        return buffers.setdefault((owner, mb), len(buffers))

    out: list[ds_schedule.PipeInstruction] = []
    for op in program.ops:
        if isinstance(op, LoadMicroBatch):
            out.append(LoadAddressed(buf(op.owner, op.mb), owner=op.owner, mb=op.mb))
        elif isinstance(op, RecvActivation):
            out.append(RecvActivationFrom(buf(op.owner, op.mb), peer=rank_of(plan, op.peer, s - 1, tp_index)))
        elif isinstance(op, Forward):
            out.append(ds_schedule.ForwardPass(buf(op.owner, op.mb)))
        elif isinstance(op, SendActivation):
            out.append(SendActivationTo(buf(op.owner, op.mb), peer=rank_of(plan, op.peer, s + 1, tp_index)))
        elif isinstance(op, RecvGrad):
            out.append(RecvGradFrom(buf(op.owner, op.mb), peer=rank_of(plan, op.peer, s + 1, tp_index)))
        elif isinstance(op, Backward):
            if op.split:
                raise ValueError("the DeepSpeed engine runs 1F1B/GPipe; a split backward (ZB-H1) is not supported")
            out.append(ds_schedule.BackwardPass(buf(op.owner, op.mb)))
        elif isinstance(op, SendGrad):
            out.append(SendGradTo(buf(op.owner, op.mb), peer=rank_of(plan, op.peer, s - 1, tp_index)))
        elif isinstance(op, BackwardWeight):
            raise ValueError("the DeepSpeed engine has no separate weight-gradient pass (ZB-H1)")
        elif isinstance(op, ReduceGrads):
            out += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads()]
        elif isinstance(op, OptimizerStep):
            out += [CommitPoint(), ds_schedule.OptimizerStep()]
        else:
            raise ValueError(f"the DeepSpeed engine cannot run primitive {op!r}")
    return LoweredSchedule([[c] for c in out], buffers)


# ----------------------------------------------------------------- the engine
def _as_list(x: Any) -> list[torch.Tensor]:
    return [x] if torch.is_tensor(x) else list(x)


_META_LEN = 64


class ResiPipelineEngine(PipelineEngine):
    """A :class:`PipelineEngine` that runs ResiHP programs (see the module docstring).

    Set :attr:`plan`, :attr:`program` and :attr:`source` (:meth:`set_work`) before
    :meth:`train_batch`; :attr:`iteration` addresses the micro-batches and advances after
    each committed step. ``commit_hook(engine) -> bool`` runs at the commit point; when it
    returns False the iteration is abandoned (gradients zeroed, no step) and
    :meth:`train_batch` raises :class:`IterationAborted`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from deepspeed.runtime.pipe import p2p

        model = kwargs.get("model")
        #: A partial-replica plan (docs/deepspeed.md, partial replicas): a stage of this
        #: rank's replica may have no rank, so DeepSpeed's start-up exchange with the
        #: neighbouring stage of the same replica is skipped (the engine's own
        #: point-to-point names its peers), and the reductions are the engine's own.
        self.partial = isinstance(getattr(model, "_topo", None), PartialTopology)
        send, recv = p2p.send, p2p.recv
        if self.partial:
            p2p.send = p2p.recv = lambda *a, **k: None
        try:
            super().__init__(*args, **kwargs)
        finally:
            p2p.send, p2p.recv = send, recv
        if not isinstance(self.module, ResiPipelineModule):
            raise TypeError("ResiPipelineEngine needs a ResiPipelineModule")
        if self.partial and (self.zero_optimization_stage() > 0 or self.bfloat16_enabled() or self.fp16_enabled()):
            raise ValueError("a partial-replica plan runs with ZeRO 0 and fp32/fp64 only (docs/deepspeed.md)")
        self.plan: ParallelPlan | None = None
        self.program: Program | None = None
        self.source: Any = None
        self.iteration = 0
        self.tp_index = self.grid.get_slice_parallel_rank() if self.grid.get_slice_parallel_world_size() > 1 else 0
        self.commit_hook: Callable[[ResiPipelineEngine], bool] | None = None
        # Called before instruction k (progress beat, abort when superseded), before each
        # receive/reduction ("comm") and after each compute chunk ("compute", seconds).
        self.step_hook: Callable[[int, int], None] | None = None
        self.fault_hook: Callable[[str, float], None] | None = None
        # Each micro-batch loss is divided by this before backward; DeepSpeed then averages
        # over its replicas. None: DeepSpeed's gradient_accumulation_steps (stock).
        self.loss_divisor: float | None = None
        self.micro_batch_address: Callable[[int, int], tuple[int, int]] | None = None
        # Micro-batches per data shard and iteration, for DeepSpeed's per-layer dropout
        # seed (``PipelineModule.micro_offset``); None: this plan's count.
        self.rng_microbatches: int | None = None
        # Layers of stage 0 in the job's initial partition: DeepSpeed's gradient-norm
        # clipping counts only those (see :meth:`clip_fp32_gradients`); None: this layout's.
        self.clip_norm_layers: range | None = None
        self.timings: list[tuple[str, int, int, float]] = []
        self._lowered: LoweredSchedule | None = None
        self._owner_mb: dict[int, tuple[int, int]] = {}
        self._pending: list[Any] = []
        self._keep: list[Any] = []
        self._meta_sent: set[int] = set()
        self._recv_specs: dict[int, list[tuple[torch.Size, torch.dtype]]] = {}
        self.pipe_buffers["losses"] = []
        self.pipe_buffers["grads"] = []
        if self._config.communication_data_type is None and any(
            p.dtype == torch.float64 for p in self.module.parameters()
        ):
            # DeepSpeed reduces gradients in float32 unless told otherwise, and its JSON
            # config cannot say float64: keep a float64 model's reduction exact.
            self.communication_data_type = torch.float64

    def _configure_zero_optimizer(self, optimizer: Any) -> Any:
        """DeepSpeed's own ZeRO stage 1 optimizer (the optimizer state and master weights
        partitioned over each stage's data-parallel ranks). For a float64 model it keeps
        float64 throughout: DeepSpeed would reduce and accumulate gradients in float32
        (its JSON cannot say float64), keep float32 master weights and sum the gradient
        norm in float32,
        which would make a float64 job's result depend on the partition
        (``docs/deepspeed.md``, ZeRO)."""
        if not any(p.dtype == torch.float64 for p in self.module.parameters()):
            return super()._configure_zero_optimizer(optimizer)
        import deepspeed.runtime.engine as ds_engine

        self.communication_data_type = torch.float64
        stock = ds_engine.DeepSpeedZeroOptimizer
        ds_engine.DeepSpeedZeroOptimizer = _float64_zero_optimizer(stock)
        try:
            return super()._configure_zero_optimizer(optimizer)
        finally:
            ds_engine.DeepSpeedZeroOptimizer = stock

    def _configure_bf16_optimizer(self, optimizer: Any) -> Any:
        """DeepSpeed's ``BF16_Optimizer``, with the fp32 master weights and their optimizer
        state kept whole on every replica: DeepSpeed partitions them over the stage's
        data-parallel ranks (as ZeRO 1 would), so a dead rank would take its part of
        them along. Gradients are still all-reduced in full over the replicas, so each
        replica steps the same update (``docs/deepspeed.md``)."""
        mpu = self.mpu
        if mpu is None or mpu.get_slice_parallel_world_size() != 1:
            raise ValueError("bf16 with tensor parallelism: ResiHP's DeepSpeed adapter keeps the fp32 master "
                             "weights whole per rank and supports bf16 with TP degree 1 only")
        saved = self.seq_data_parallel_group
        self.seq_data_parallel_group = mpu.get_slice_parallel_group()  # this rank alone
        try:
            bf = super()._configure_bf16_optimizer(optimizer)
        finally:
            self.seq_data_parallel_group = saved
        # A stage whose only parameters are a tied copy another stage owns (a plan may cut
        # it so) has no gradient for the norm, and DeepSpeed's norm of an empty list
        # raises: give it a zero, which adds nothing to the global norm.
        counted = bf.get_grads_for_norm

        def grads_for_norm(for_clipping: bool = False) -> Any:
            out = counted(for_clipping=for_clipping)
            if not for_clipping and not out[0]:
                return [torch.zeros(1, dtype=torch.float32)], out[1]
            return out

        bf.get_grads_for_norm = grads_for_norm
        return bf

    # -------------------------------------------------------------- configuration
    def set_work(self, plan: ParallelPlan, program: Program, source: Any) -> None:
        """The plan generation, this executor's program and the micro-batch source."""
        if (ds_replica(plan, program.replica), program.stage) != (self.grid.data_parallel_id, self.stage_id):
            raise ValueError(
                f"program for replica {program.replica} stage {program.stage} given to the rank "
                f"at replica {self.grid.data_parallel_id} stage {self.stage_id}"
            )
        self.plan, self.program, self.source = plan, program, source
        self._lowered = lower_program(program, plan, self.tp_index)
        self._owner_mb = {b: k for k, b in self._lowered.buffers.items()}

    def _train_schedule(self) -> LoweredSchedule:
        if self._lowered is None:
            raise RuntimeError("ResiPipelineEngine.set_work() was not called before train_batch()")
        return self._lowered

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One iteration of this executor's program; returns DeepSpeed's aggregated loss."""
        self.timings = []
        self._pending, self._keep = [], []
        self._aborted = False
        try:
            loss = super().train_batch(data_iter)
        except BaseException:
            # A peer is gone: do not wait on sends to it, and drop every work handle (each
            # keeps the group's connections alive, so peers would block until timeout).
            self._pending, self._keep = [], []
            raise
        self._drain()
        if self._aborted:
            raise IterationAborted(f"iteration {self.iteration} was not committed")
        self.iteration += 1
        return loss

    def gradient_accumulation_steps(self) -> Any:
        """DeepSpeed divides every micro-batch loss by this (and averages over its
        replicas): the global batch over the live replicas when ResiHP sets
        :attr:`loss_divisor`, else the configured value."""
        d = getattr(self, "loss_divisor", None)
        if d is None:
            return super().gradient_accumulation_steps()
        return int(d) if float(d).is_integer() else d

    def eval_batch(self, data_iter: Any, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's own ``eval_batch`` (its inference schedule, stock handlers and
        peers within this rank's replica) on this generation's engine."""
        if self.partial:
            raise RuntimeError("eval_batch runs DeepSpeed's inference schedule within a replica; this plan "
                               "generation keeps only part of some replica (docs/deepspeed.md, partial replicas)")
        self._evaluating = True
        try:
            return super().eval_batch(data_iter, *args, **kwargs)
        finally:
            self._evaluating = False

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        if getattr(self, "_evaluating", False):
            return super()._exec_schedule(pipe_schedule)
        if self.step_hook is None:
            super()._exec_schedule(pipe_schedule)
        else:
            self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
            self.fwd_outputs = []
            for k, cmd in enumerate(pipe_schedule.instructions()):
                self.step_hook(self.iteration, k)
                self._exec_instr = MethodType(self._INSTRUCTION_MAP[type(cmd)], self)
                self._exec_instr(**cmd.kwargs)
        if self.is_last_stage() and self.total_loss is None:
            # This replica's last stage ran no micro-batch (all migrated away).
            self.total_loss = torch.zeros((), dtype=torch.get_default_dtype(), device=self.device)

    # -------------------------------------------------------------- p2p helpers
    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for w in pending:
            p2p_wait(w)
        self._keep = []

    def _isend(self, tensor: torch.Tensor, peer: int) -> None:
        t = tensor.detach().contiguous()
        self._keep.append(t)
        self._pending.append(tdist.isend(t, dst=peer))

    def _send_meta(self, tensors: list[torch.Tensor], peer: int) -> None:
        meta = [len(tensors)]
        for t in tensors:
            meta += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        if len(meta) > _META_LEN:
            raise ValueError(f"activation metadata of {len(meta)} ints exceeds {_META_LEN}")
        buf = torch.zeros(_META_LEN, dtype=torch.int64)
        buf[: len(meta)] = torch.tensor(meta, dtype=torch.int64)
        # Not gloo's blocking send: it waits for the peer's matching receive, and a peer
        # that left the generation never posts one (the op timeout, ~10 s, after a kill).
        p2p_wait(tdist.isend(buf, dst=peer))

    def _recv_meta(self, peer: int) -> list[tuple[torch.Size, torch.dtype]]:
        buf = torch.zeros(_META_LEN, dtype=torch.int64)
        p2p_wait(tdist.irecv(buf, src=peer))
        vals = buf.tolist()
        n, pos, specs = vals[0], 1, []
        for _ in range(n):
            dtype, nd = self.ID_TO_DTYPE[vals[pos]], vals[pos + 1]
            specs.append((torch.Size(vals[pos + 2 : pos + 2 + nd]), dtype))
            pos += 2 + nd
        return specs

    # -------------------------------------------------------------- handlers
    def _exec_load_addressed(self, buffer_id: int, owner: int, mb: int) -> None:
        if self.micro_batch_address is not None:
            owner, mb = self.micro_batch_address(owner, mb)
        batch = self.source.micro_batch(self.iteration, owner, mb)
        saved = self.data_iterator
        self.data_iterator = iter((batch,))
        try:
            super()._exec_load_micro_batch(buffer_id)
        finally:
            self.data_iterator = saved

    def _exec_forward(self, buffer_id: int) -> None:
        if getattr(self, "_evaluating", False):
            return super()._exec_forward_pass(buffer_id)
        timer = ChunkTimer(torch.device(self.device)).start()  # CUDA events on a GPU (docs/gpu.md)
        # DeepSpeed seeds each layer's forward from the count of forwards this rank ran
        # (``seed_layers``). Set that count from the micro-batch's data address instead,
        # so a moved, migrated or replayed micro-batch draws the dropout masks the
        # fault-free run drew (and the fault-free run draws stock DeepSpeed's).
        owner, mb = self._owner_mb[buffer_id]
        if self.micro_batch_address is not None:
            _, mb = self.micro_batch_address(owner, mb)
        m = self.rng_microbatches or (self.plan.num_microbatches if self.plan is not None else self.micro_batches)
        self.module.micro_offset = self.iteration * m + mb
        super()._exec_forward_pass(buffer_id)
        if self.is_last_stage():
            self.pipe_buffers["losses"][buffer_id] = self.loss
        owner, mb = self._owner_mb[buffer_id]
        dt, t1 = timer.stop(), time.perf_counter()
        if self.fault_hook is not None:
            self.fault_hook("compute", dt)
        self.timings.append(("F", owner, mb, dt + time.perf_counter() - t1))

    def _exec_backward(self, buffer_id: int) -> None:
        timer = ChunkTimer(torch.device(self.device)).start()
        if self.is_last_stage():
            self.loss = self.pipe_buffers["losses"][buffer_id]
            self.pipe_buffers["losses"][buffer_id] = None
        else:
            self.grad_layer = self.pipe_buffers["grads"][buffer_id]
            self.pipe_buffers["grads"][buffer_id] = None
        super()._exec_backward_pass(buffer_id)
        self.grad_layer = None
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["labels"][buffer_id] = None
        if self.is_first_stage():
            self.pipe_buffers["inputs"][buffer_id] = None
        owner, mb = self._owner_mb[buffer_id]
        dt, t1 = timer.stop(), time.perf_counter()
        if self.fault_hook is not None:
            self.fault_hook("compute", dt)
        self.timings.append(("B", owner, mb, dt + time.perf_counter() - t1))

    def _exec_send_activation_to(self, buffer_id: int, peer: int) -> None:
        tensors = _as_list(self.pipe_buffers["outputs"][buffer_id])
        if peer not in self._meta_sent:
            self._send_meta(tensors, peer)
            self._meta_sent.add(peer)
        for t in tensors:
            self._isend(t, peer)

    def _exec_recv_activation_from(self, buffer_id: int, peer: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook("comm", 0.0)
        specs = self._recv_specs.get(peer)
        if specs is None:
            specs = self._recv_specs[peer] = self._recv_meta(peer)
        recvd = []
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            p2p_wait(tdist.irecv(t, src=peer))
            t.requires_grad = t.is_floating_point()
            recvd.append(t)
        self.pipe_buffers["inputs"][buffer_id] = recvd[0] if len(recvd) == 1 else tuple(recvd)

    def _exec_send_grad_to(self, buffer_id: int, peer: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        for t in _as_list(inputs):
            if t.is_floating_point():
                if t.grad is None:
                    raise RuntimeError(f"stage {self.stage_id}: an input of buffer {buffer_id} has no gradient")
                self._isend(t.grad, peer)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grad_from(self, buffer_id: int, peer: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook("comm", 0.0)
        outputs = self.pipe_buffers["outputs"][buffer_id]
        grads = [torch.empty_like(t) for t in _as_list(outputs) if t.is_floating_point()]
        for g in grads:
            p2p_wait(tdist.irecv(g, src=peer))
        self.pipe_buffers["grads"][buffer_id] = grads[0] if torch.is_tensor(outputs) else grads

    def _exec_commit_point(self) -> None:
        self._drain()
        ok = True if self.commit_hook is None else bool(self.commit_hook(self))
        if not ok:
            from resihp_adapters.deepspeed.state import zero_grads

            self._aborted = True
            zero_grads(self)

    def _exec_reduce(self) -> None:
        if self.fault_hook is not None:
            self.fault_hook("comm", 0.0)
        if self.partial:
            self._reduce_partial()
        else:
            super()._exec_reduce_grads()

    def _exec_reduce_tied(self) -> None:
        if not self.partial:
            return super()._exec_reduce_tied_grads()
        # Every copy's holder takes part, with or without a gradient (or it would hang).
        for weight, group in self.module.get_tied_weights_and_groups():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            all_reduce(weight.grad, group=group)

    def _reduce_partial(self) -> None:
        """The data-parallel reduction of a partial-replica plan: a *sum* over the
        stage's present replicas (the loss divisor is the whole global batch, as the
        stage's replica counts differ), in one flat buffer per dtype; tied weights were
        already summed over every copy (:meth:`ResiPipelineModule._index_tied_modules`)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        group = self.grid.get_data_parallel_group()
        if len(self.grid.get_data_parallel_group_ranks()) < 2:
            return
        tied = {id(w) for w, _ in self.module.get_tied_weights_and_groups()}
        params = [p for p in self.module.parameters() if p.requires_grad and id(p) not in tied]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in sorted({p.grad.dtype for p in params}, key=str):
            grads = [p.grad.data for p in params if p.grad.dtype == dtype]
            flat = _flatten_dense_tensors(grads)
            all_reduce(flat, group=group)
            for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(r)

    def _aggregate_total_loss(self) -> Any:
        """DeepSpeed's mean loss over the global batch. A partial-replica plan has
        last stages holding different numbers of micro-batches: each contributes its
        loss sum over the whole batch's size, summed over the world (every rank gets it)."""
        if not self.partial:
            return super()._aggregate_total_loss()
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.is_last_stage() and self.total_loss is not None:
            loss += self._scale_loss_by_gas(self.total_loss.detach()).to(torch.float64)
        all_reduce(loss)
        self.dp_group_loss = loss
        return loss

    def _exec_guarded_step(self, lr_kwargs: Any = None) -> None:
        if getattr(self, "_aborted", False):
            return
        hook = getattr(self, "sdc_step", None)  # injected flips, the range signal (deepspeed/sdc.py)
        if hook is not None:
            hook(self, lambda: super(ResiPipelineEngine, self)._exec_optimizer_step(lr_kwargs))
            return
        super()._exec_optimizer_step(lr_kwargs)

    def clip_fp32_gradients(self) -> None:
        """DeepSpeed's fp32 gradient clipping, independent of the layout.

        DeepSpeed's ``clip_grad_norm_`` counts a parameter only on model-parallel rank
        0, which in a pipeline is stage 0: the norm is that of stage 0's gradients (tied
        copies there included). Which layers sit on stage 0 changes with a repartition,
        so the clip factor would change too. This computes the same norm over the layers
        stage 0 held in the job's *initial* partition (:attr:`clip_norm_layers`), from
        every stage's per-parameter norms in DeepSpeed's order, with DeepSpeed's own
        float32 arithmetic: bit-identical to stock DeepSpeed in the initial layout, and
        unchanged by any later one (``docs/deepspeed.md``)."""
        from deepspeed.runtime.utils import is_model_parallel_parameter
        from deepspeed.utils import groups

        keep = self.clip_norm_layers
        if keep is None or self.grid.get_slice_parallel_world_size() != 1 or any(
                is_model_parallel_parameter(p) for p in self.module.parameters()):
            return super().clip_fp32_gradients()
        tied = {}
        for idx, spec in enumerate(self.module._layer_specs):
            key = getattr(spec, "key", None)
            if key is not None and hasattr(spec, "tied_weight_attr"):
                tied.setdefault(key, idx)  # the first layer using it: where its copy is built first
        counted = {k for k, idx in tied.items()
                   if any(i in keep for i, s in enumerate(self.module._layer_specs) if getattr(s, "key", None) == k)}

        def order(name: str) -> tuple[int, int] | None:
            head = name.split(".", 2)
            if head[0] == "tied_modules":
                return (0, tied[head[1]]) if head[1] in counted else None
            return (1, int(head[0])) if int(head[0]) in keep else None

        params = [p for p in self.module.parameters() if p.grad is not None]
        mine = [(n, order(n), i, p.grad.data.detach().float().norm(2.0)) for i, (n, p) in
                enumerate((n, p) for n, p in self.module.named_parameters() if p.grad is not None)]
        mine = [m for m in mine if m[1] is not None]
        # A partial-replica plan: this replica may miss a stage, so gather from the whole
        # world (every copy of a parameter holds the same reduced gradient).
        group = None if self.partial else self.mpu.get_model_parallel_group()
        gathered = self._gather_norms(mine, group)
        seen: dict[str, tuple[tuple[int, int], int, torch.Tensor]] = {}
        for part in gathered:
            for n, o, i, v in part:
                seen.setdefault(n, (o, i, v))  # a tied copy held by several stages counts once
        norms = [v for o, i, v in sorted(seen.values(), key=lambda t: (t[0], t[1]))]
        total = torch.stack(norms).pow(2.0).sum().float() if norms else torch.zeros(1, dtype=torch.float32)
        total = total.pow(1.0 / 2.0)
        scaled = total
        if not self.partial:  # (the same value on every replica: DeepSpeed averages it)
            pg = groups._get_data_parallel_group()
            scaled = total * 1.0 / float(tdist.get_world_size(group=pg))
            all_reduce(scaled, group=pg)
        clip = torch.tensor([float(self.gradient_clipping())]) / (scaled + 1e-6)
        clip = torch.min(torch.tensor([1.0]), clip)
        for p in params:
            p.grad.data.mul_(clip)

    def _gather_norms(self, mine: list[tuple[str, tuple[int, int], int, torch.Tensor]],
                      group: Any) -> list[list[tuple[str, tuple[int, int], int, torch.Tensor]]]:
        """Every rank's ``(name, order, index, norm)`` list, as :func:`gather_objects`
        returns it. The names, orders and indices depend only on the module and on which
        parameters have gradients, so they travel once per engine (and again if any
        rank's change); after that only the norms do, one float32 tensor per rank with
        a leading changed-flag (the same values: each norm is a float32 0-dim tensor)."""
        meta = [(n, o, i) for n, o, i, _ in mine]
        cached = getattr(self, "_norm_meta", None)
        if cached is not None:
            local, metas = cached
            width = max(len(m) for m in metas)
            changed = meta != local or len(mine) > width
            buf = torch.zeros(width + 1, dtype=torch.float32)
            buf[0] = float(changed)
            if mine and not changed:
                buf[1:1 + len(mine)] = torch.stack([v for *_, v in mine])
            out = [torch.empty_like(buf) for _ in range(tdist.get_world_size(group=group))]
            p2p_wait(tdist.all_gather(out, buf, group=group, async_op=True))
            if not any(float(t[0]) for t in out):  # every rank decides alike from the same tensors
                return [[(n, o, i, t[1 + k]) for k, (n, o, i) in enumerate(m)] for m, t in zip(metas, out)]
        parts = gather_objects(mine, group)
        self._norm_meta = (meta, [[(n, o, i) for n, o, i, _ in part] for part in parts])
        return parts

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        LoadAddressed: _exec_load_addressed,
        ds_schedule.ForwardPass: _exec_forward,
        ds_schedule.BackwardPass: _exec_backward,
        SendActivationTo: _exec_send_activation_to,
        RecvActivationFrom: _exec_recv_activation_from,
        SendGradTo: _exec_send_grad_to,
        RecvGradFrom: _exec_recv_grad_from,
        CommitPoint: _exec_commit_point,
        ds_schedule.ReduceGrads: _exec_reduce,
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied,
        ds_schedule.OptimizerStep: _exec_guarded_step,
    }


def _float64_zero_optimizer(stock: type) -> type:
    """DeepSpeed's ZeRO 1/2 optimizer class with float64 master weights and a float64
    gradient norm (for float64 models only; see ``_configure_zero_optimizer``)."""
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter

    class Float64ZeroOptimizer(stock):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # DeepSpeed takes a model without fp16/bf16 for float32 and would accumulate
            # and partition the gradients in float32.
            kwargs["gradient_accumulation_dtype"] = torch.float64
            super().__init__(*args, **kwargs)

        def _configure_master_weights(self, *args: Any, **kwargs: Any) -> torch.dtype:
            super()._configure_master_weights(*args, **kwargs)
            return torch.float64

        def get_grad_norm_direct(self, gradients: Any, params: Any, norm_type: float = 2) -> torch.Tensor:
            # DeepSpeed's L2 norm (each parameter once: replicated tied copies skipped,
            # model-parallel rank 0 counts the rest), summed in float64 over the data-
            # and model-parallel groups instead of float32.
            if float(norm_type) != 2.0:
                return super().get_grad_norm_direct(gradients, params, norm_type)
            total = torch.zeros((), dtype=torch.float64)
            grads = (g for g in gradients if not getattr(g, "_zero_padding", False))
            for g, p in zip(grads, params):
                if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                    continue
                if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
                    total += g.detach().to(torch.float64).pow(2).sum()
            all_reduce(total, group=self.dp_process_group)
            if self.model_parallel_group is not None:
                all_reduce(total, group=self.model_parallel_group)
            return total.sqrt()

    return Float64ZeroOptimizer


class IterationAborted(RuntimeError):
    """The commit hook refused the iteration; nothing was stepped."""
