"""Lower the core's per-executor programs into torch.distributed.pipelining actions.

The core emits one :class:`~resihp_core.program.Program` per (replica, stage). torch's
``_PipelineScheduleRuntime`` runs one *pipeline group* (one replica's stages, group rank
= stage index) from per-rank ``_Action`` lists in its "compute + comms" form. The
primitives map one to one:

==================  ===================  ==================================
core primitive      torch action         note
==================  ===================  ==================================
RecvActivation      ``sRECV_Fj``         irecv now, waited on by the forward
Forward             ``sFj``
SendActivation      ``sSEND_Fj``         isend, waited at the end of the step
RecvGrad            ``sRECV_Bj``
Backward            ``sBj`` / ``sIj``    ``split`` (ZB-H1) -> input-gradient only
BackwardWeight      ``sWj``
SendGrad            ``sSEND_Bj``
ReduceGrads         ``sREDUCE_GRAD``     FSDP2 reduce-scatter (+ HSDP all-reduce)
OptimizerStep       (none)               the adapter steps its optimizer after the runtime
LoadMicroBatch      (none)               inputs are handed to the runtime up front
==================  ===================  ==================================

``sUNSHARD`` opens and ``sRESHARD`` closes every list (FSDP2 all-gathers the stage's
parameters once per step and frees them after the gradient reduction).

Micro-batches: the runtime numbers one pipeline group's micro-batches 0..n-1; the core
names them ``(owner, mb)``. ``index`` maps one to the other: the executing replica's work
(``ParallelPlan.work``), its own micro-batches and those migrated to it *whole* (every
stage on this replica), so replicas run uneven counts (``uneven_dp``).

What does not fit: a schedule covers one pipeline group and a stage only talks to stage
± 1 of its own group, so a single stage migrated to another replica (``peer !=
replica``) has no action; :func:`lower_program` refuses it and the adapter does not
declare ``cross_replica_migration`` (docs/torch_native.md "Migration").
"""

from __future__ import annotations

from typing import Iterable

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

__all__ = ["LoweringError", "lower_program", "lower_pipeline"]


class LoweringError(ValueError):
    """A program uses something torch's pipeline runtime cannot express."""


def lower_program(program: Program, index: dict[tuple[int, int], int] | None = None) -> list:
    """The ``_Action`` list (compute + comms form) of one executor's program.
    ``index``: (owner, mb) -> the runtime's micro-batch index (default: ``mb``, the
    replica's own micro-batches only)."""
    from torch.distributed.pipelining.schedules import (
        BACKWARD_INPUT,
        BACKWARD_WEIGHT,
        FORWARD,
        FULL_BACKWARD,
        RECV_B,
        RECV_F,
        REDUCE_GRAD,
        RESHARD,
        SEND_B,
        SEND_F,
        UNSHARD,
        _Action,
    )

    r, s = program.replica, program.stage
    out = [_Action(s, UNSHARD, None)]
    for i, op in enumerate(program.ops):
        owner = getattr(op, "owner", r)
        peer = getattr(op, "peer", r)
        if peer != r:
            raise LoweringError(
                f"replica {r} stage {s} op #{i} {op!r}: micro-batch of replica {owner} "
                f"exchanged with replica {peer}; torch pipelining runs one replica's pipeline per "
                "schedule, so torch_native migrates micro-batches only whole (every stage)"
            )
        if isinstance(op, (LoadMicroBatch, OptimizerStep)):
            continue
        mb = None
        if hasattr(op, "mb"):
            if index is None:
                if owner != r:
                    raise LoweringError(f"replica {r} stage {s} op #{i} {op!r}: another replica's "
                                        "micro-batch needs an index of the replica's work")
                mb = op.mb
            elif (owner, op.mb) not in index:
                raise LoweringError(f"replica {r} stage {s} op #{i} {op!r}: not in the replica's work")
            else:
                mb = index[(owner, op.mb)]
        if getattr(op, "stage", s) != s:
            raise LoweringError(f"replica {r} stage {s} op #{i} {op!r} names another stage")
        if isinstance(op, RecvActivation):
            out.append(_Action(s, RECV_F, mb))
        elif isinstance(op, Forward):
            out.append(_Action(s, FORWARD, mb))
        elif isinstance(op, SendActivation):
            out.append(_Action(s, SEND_F, mb))
        elif isinstance(op, RecvGrad):
            out.append(_Action(s, RECV_B, mb))
        elif isinstance(op, Backward):
            out.append(_Action(s, BACKWARD_INPUT if op.split else FULL_BACKWARD, mb))
        elif isinstance(op, BackwardWeight):
            out.append(_Action(s, BACKWARD_WEIGHT, mb))
        elif isinstance(op, SendGrad):
            out.append(_Action(s, SEND_B, mb))
        elif isinstance(op, ReduceGrads):
            out.append(_Action(s, REDUCE_GRAD, None))
        else:
            raise LoweringError(f"replica {r} stage {s} op #{i}: torch_native cannot lower {op!r}")
    out.append(_Action(s, RESHARD, None))
    return out


def lower_pipeline(programs: Iterable[Program], replica: int,
                   index: dict[tuple[int, int], int] | None = None) -> dict[int, list]:
    """Group rank (= stage index) -> actions, for every stage of ``replica``'s pipeline:
    the runtime validates and maps stages to ranks from the whole group's lists."""
    out = {p.stage: lower_program(p, index) for p in programs if p.replica == replica}
    if sorted(out) != list(range(len(out))):
        raise LoweringError(f"replica {replica}: programs cover stages {sorted(out)}, not 0..{len(out) - 1}")
    return out
