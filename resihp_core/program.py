"""Per-executor programs of primitives, the dry-run checker and the step x rank grid.

The Scheduler emits one :class:`Program` per *executor* — a (replica, stage) TP group;
every rank of that group runs the same program (tensor parallelism happens inside each
compute primitive). Adapters lower primitives into their framework's instructions.

Primitives name micro-batch ``(owner, mb)``: ``owner`` is the replica whose share of
the global batch the micro-batch belongs to, which differs from the executing replica
for migrated work. Point-to-point primitives name the *peer replica* executing the
neighbouring stage of that micro-batch; the adapter maps it to ranks (docs/design.md §5.1).

Semantics the checker (and every adapter) relies on: sends are non-blocking
(buffered/``isend``), receives block until the matching send was issued, and
``ReduceGrads(stage)`` is a collective over every executor of that stage.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Iterable, Mapping, Union

import msgspec

__all__ = [
    "LoadMicroBatch",
    "Forward",
    "Backward",
    "BackwardWeight",
    "SendActivation",
    "RecvActivation",
    "SendGrad",
    "RecvGrad",
    "ReduceGrads",
    "OptimizerStep",
    "SendLayerState",
    "RecvLayerState",
    "Primitive",
    "Program",
    "ProgramError",
    "check_programs",
    "format_grid",
]


class ProgramError(ValueError):
    """A set of programs is inconsistent (unmatched send/recv, deadlock, duplicate work)."""


class _Op(msgspec.Struct, frozen=True, tag_field="op"):
    pass


class LoadMicroBatch(_Op, tag="load"):
    """Read the tokens (and document boundaries) of micro-batch (owner, mb)."""

    owner: int
    mb: int


class Forward(_Op, tag="F"):
    stage: int
    owner: int
    mb: int


class Backward(_Op, tag="B"):
    """Backward of one stage; ``split`` = input gradient only (ZB-H1), W comes later."""

    stage: int
    owner: int
    mb: int
    split: bool = False


class BackwardWeight(_Op, tag="W"):
    stage: int
    owner: int
    mb: int


class SendActivation(_Op, tag="send_act"):
    """Send stage ``stage``'s output for (owner, mb) to replica ``peer``'s stage+1."""

    stage: int
    owner: int
    mb: int
    peer: int


class RecvActivation(_Op, tag="recv_act"):
    """Receive stage ``stage``'s input for (owner, mb) from replica ``peer``'s stage-1."""

    stage: int
    owner: int
    mb: int
    peer: int


class SendGrad(_Op, tag="send_grad"):
    """Send the input gradient of ``stage`` for (owner, mb) to replica ``peer``'s stage-1."""

    stage: int
    owner: int
    mb: int
    peer: int


class RecvGrad(_Op, tag="recv_grad"):
    """Receive the output gradient of ``stage`` for (owner, mb) from ``peer``'s stage+1."""

    stage: int
    owner: int
    mb: int
    peer: int


class ReduceGrads(_Op, tag="reduce"):
    """DP gradient reduction of ``stage`` over every replica executing it."""

    stage: int


class OptimizerStep(_Op, tag="step"):
    stage: int


class SendLayerState(_Op, tag="send_layer"):
    """Send parameters and optimizer state of ``layer`` to (replica, stage)."""

    layer: int
    replica: int
    stage: int


class RecvLayerState(_Op, tag="recv_layer"):
    """Receive parameters and optimizer state of ``layer`` from (replica, stage)."""

    layer: int
    replica: int
    stage: int


Primitive = Union[
    LoadMicroBatch,
    Forward,
    Backward,
    BackwardWeight,
    SendActivation,
    RecvActivation,
    SendGrad,
    RecvGrad,
    ReduceGrads,
    OptimizerStep,
    SendLayerState,
    RecvLayerState,
]


class Program(msgspec.Struct, frozen=True):
    """What executor (replica, stage) runs in one iteration of plan ``generation``."""

    replica: int
    stage: int
    generation: int
    ops: tuple[Primitive, ...]


# ---------------------------------------------------------------- dry-run checker
def _channel(prog: Program, op: _Op) -> tuple | None:
    """The message key a send/recv op uses, identical for both ends."""
    r, s = prog.replica, prog.stage
    if isinstance(op, SendActivation):
        return ("act", op.stage, op.owner, op.mb, r, op.peer)
    if isinstance(op, RecvActivation):
        return ("act", op.stage - 1, op.owner, op.mb, op.peer, r)
    if isinstance(op, SendGrad):
        return ("grad", op.stage, op.owner, op.mb, r, op.peer)
    if isinstance(op, RecvGrad):
        return ("grad", op.stage + 1, op.owner, op.mb, op.peer, r)
    if isinstance(op, SendLayerState):
        return ("layer", op.layer, (r, s), (op.replica, op.stage))
    if isinstance(op, RecvLayerState):
        return ("layer", op.layer, (op.replica, op.stage), (r, s))
    return None


_SENDS = (SendActivation, SendGrad, SendLayerState)
_RECVS = (RecvActivation, RecvGrad, RecvLayerState)


def _where(prog: Program, i: int) -> str:
    return f"replica {prog.replica} stage {prog.stage} op #{i} {prog.ops[i]!r}"


def check_programs(programs: Iterable[Program]) -> None:
    """Prove the programs run to completion: every send has exactly one receive, each
    (stage, micro-batch) forward and backward runs exactly once, and executing them
    (buffered sends, blocking receives, collective ReduceGrads) never deadlocks.
    Raises :class:`ProgramError` naming the executor and op at fault."""
    progs = list(programs)
    keys = [(p.replica, p.stage) for p in progs]
    if len(set(keys)) != len(keys):
        raise ProgramError("two programs for the same (replica, stage)")
    sends: dict[tuple, str] = {}
    recvs: dict[tuple, str] = {}
    fwd: dict[tuple[int, int, int], str] = {}
    bwd: dict[tuple[int, int, int], str] = {}
    wgt: dict[tuple[int, int, int], str] = {}
    reducers: dict[int, int] = defaultdict(int)
    for p in progs:
        for i, op in enumerate(p.ops):
            ch = _channel(p, op)
            if ch is not None:
                book = sends if isinstance(op, _SENDS) else recvs
                if ch in book:
                    raise ProgramError(f"{_where(p, i)} duplicates {book[ch]}")
                book[ch] = _where(p, i)
            if isinstance(op, (Forward, Backward, BackwardWeight)):
                if op.stage != p.stage:
                    raise ProgramError(f"{_where(p, i)} computes a stage this executor does not hold")
                book = fwd if isinstance(op, Forward) else bwd if isinstance(op, Backward) else wgt
                k = (op.stage, op.owner, op.mb)
                if k in book:
                    raise ProgramError(
                        f"{_where(p, i)}: stage {op.stage} of (replica {op.owner}, mb {op.mb}) "
                        f"runs twice (also {book[k]})"
                    )
                book[k] = _where(p, i)
            if isinstance(op, ReduceGrads):
                reducers[op.stage] += 1
    for ch, w in sends.items():
        if ch not in recvs:
            raise ProgramError(f"{w} has no matching receive")
    for ch, w in recvs.items():
        if ch not in sends:
            raise ProgramError(f"{w} has no matching send")
    for k, w in fwd.items():
        if k not in bwd:
            raise ProgramError(f"{w}: forward without a backward")
    for k, w in bwd.items():
        if k not in fwd:
            raise ProgramError(f"{w}: backward without a forward")

    # Execute: advance any program whose next op is enabled until all finish or none can.
    pc = {k: 0 for k in keys}
    by_key = dict(zip(keys, progs))
    issued: set[tuple] = set()
    at_reduce: dict[int, set[tuple[int, int]]] = defaultdict(set)
    ready = deque(keys)
    waiting: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    while ready:
        k = ready.popleft()
        p = by_key[k]
        while pc[k] < len(p.ops):
            op = p.ops[pc[k]]
            if isinstance(op, _RECVS):
                ch = _channel(p, op)
                if ch not in issued:
                    waiting[ch].append(k)
                    break
            elif isinstance(op, ReduceGrads):
                grp = at_reduce[op.stage]
                grp.add(k)
                if len(grp) < reducers[op.stage]:
                    break
                for other in grp:
                    if other != k:
                        pc[other] += 1
                        ready.append(other)
                grp.clear()
                reducers[op.stage] = -1  # each stage reduces once per iteration
            elif isinstance(op, _SENDS):
                ch = _channel(p, op)
                issued.add(ch)
                ready.extend(waiting.pop(ch, ()))
            pc[k] += 1
    stuck = [k for k in keys if pc[k] < len(by_key[k].ops)]
    if stuck:
        detail = "; ".join(_where(by_key[k], pc[k]) for k in stuck[:4])
        raise ProgramError(f"deadlock: {len(stuck)} program(s) blocked, e.g. {detail}")


# ---------------------------------------------------------------- grid printer
def short(op: _Op, replica: int | None = None) -> str:
    """Compact action string in the spirit of torch.distributed.pipelining: ``1F3``
    (stage 1 forward of mb 3), with ``@rK`` when the micro-batch belongs to replica K
    and that is not the executing replica."""
    own = lambda o: "" if replica is None or o.owner == replica else f"@r{o.owner}"  # noqa: E731
    if isinstance(op, Forward):
        return f"{op.stage}F{op.mb}{own(op)}"
    if isinstance(op, Backward):
        return f"{op.stage}{'I' if op.split else 'B'}{op.mb}{own(op)}"
    if isinstance(op, BackwardWeight):
        return f"{op.stage}W{op.mb}{own(op)}"
    if isinstance(op, SendActivation):
        return f"{op.stage}SEND_F{op.mb}{own(op)}"
    if isinstance(op, RecvActivation):
        return f"{op.stage}RECV_F{op.mb}{own(op)}"
    if isinstance(op, SendGrad):
        return f"{op.stage}SEND_B{op.mb}{own(op)}"
    if isinstance(op, RecvGrad):
        return f"{op.stage}RECV_B{op.mb}{own(op)}"
    if isinstance(op, ReduceGrads):
        return f"{op.stage}REDUCE"
    if isinstance(op, OptimizerStep):
        return f"{op.stage}STEP"
    if isinstance(op, LoadMicroBatch):
        return f"LOAD{op.mb}{own(op)}"
    if isinstance(op, SendLayerState):
        return f"SEND_L{op.layer}"
    if isinstance(op, RecvLayerState):
        return f"RECV_L{op.layer}"
    return type(op).__name__


def format_grid(
    programs: Iterable[Program],
    *,
    compute_only: bool = True,
    ranks: Mapping[tuple[int, int], str] | None = None,
) -> str:
    """Step x executor table. ``compute_only`` keeps F/B/W (the usual pipeline picture);
    ``ranks`` optionally labels columns (e.g. with the ranks of each TP group)."""
    progs = sorted(programs, key=lambda p: (p.stage, p.replica))
    cols = []
    for p in progs:
        ops = [
            short(o, p.replica)
            for o in p.ops
            if not compute_only or isinstance(o, (Forward, Backward, BackwardWeight))
        ]
        label = (ranks or {}).get((p.replica, p.stage), f"r{p.replica}s{p.stage}")
        cols.append((label, ops))
    n = max((len(ops) for _, ops in cols), default=0)
    width = max([len(lbl) for lbl, _ in cols] + [len(x) for _, ops in cols for x in ops] + [4])
    lines = ["step  " + " ".join(lbl.ljust(width) for lbl, _ in cols)]
    for i in range(n):
        cells = [(ops[i] if i < len(ops) else "").ljust(width) for _, ops in cols]
        lines.append(f"{i:<5} " + " ".join(cells).rstrip())
    return "\n".join(lines)
