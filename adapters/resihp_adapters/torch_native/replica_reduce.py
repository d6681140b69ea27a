"""Gradient reduction of a pure-replica stage the way DDP does it.

A stage with shard degree 1 (data-parallel replicas each holding the whole stage) is
still wrapped by ``fully_shard``, so its parameters, optimizer state, snapshots, DCP
checkpoints and resharding keep the layout every other stage has. Only FSDP's gradient
reduction is replaced: on such a stage it is a copy of every gradient into one flat
buffer, a second copy through a temporary for its divide factor, and one all-reduce of
the whole stage after the last backward, not overlapped with anything
(docs/benchmarks.md, "Where a fault-free iteration goes").

:class:`ReplicaReducer` keeps DDP's arithmetic and schedule instead: persistent flat
buckets of about :data:`BUCKET_BYTES` (DDP's default cap), filled in reverse parameter
order (about the order backward produces gradients). A post-accumulate-grad hook on
each of FSDP's unsharded parameters counts the backward passes of the iteration; at the
last one it copies the finished gradient into its bucket slot, and a bucket whose slots
are all filled is all-reduced asynchronously (buckets launch in index order on every
rank, whatever order their hooks fire in), overlapping the rest of the backward.
:meth:`ReplicaReducer.finish`, before the optimizer step, fills and launches what the
hooks did not reach (a parameter without a gradient in some pass, a schedule that splits
the weight backward), waits, and hands each parameter its gradient as a view of its
bucket: the sum over replicas, as FSDP's ``SUM`` all-reduce gives (the engine's divide
factor is 1). Only the position of an element inside the reduced buffer changes, which
can change the order gloo adds the replicas' values in: equal within float64 rounding,
the same bits on every replica; with one replica, bit-identical to FSDP.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ReplicaReducer", "BUCKET_BYTES"]

#: bucket size cap: DDP's ``bucket_cap_mb`` default
BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class _Bucket:
    buffer: Tensor
    members: list[int]  # indices into the reducer's parameters
    filled: int = 0
    work: dist.Work | None = None


@dataclass
class _Slot:
    bucket: int
    view: Tensor  # the parameter's shape, inside its bucket's buffer
    passes: int = 0  # backward passes seen this iteration
    copied: bool = False  # its gradient is in the bucket
    has_grad: bool = False


@dataclass
class _Hooked:
    param: nn.Parameter
    handle: RemovableHandle


class ReplicaReducer:
    """DDP-style bucketed, overlapped all-reduce of a shard-degree-1 FSDP stage's
    gradients over ``group`` (the replicas; None or one rank: no communication).
    ``passes``: backward passes per iteration (the replica's micro-batches)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, passes: int, *,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        if passes < 1:
            raise ValueError(f"passes: a replica runs at least one backward per iteration, got {passes}")
        state = module._get_fsdp_state()
        fsdp_group = state._fsdp_param_group
        if fsdp_group is None:
            raise ValueError("the stage has no FSDP parameters to reduce")
        # frozen parameters get no gradient, as under FSDP's own reduction
        self._fsdp_params = [fp for fp in fsdp_group.fsdp_params if fp.sharded_param.requires_grad]
        for fp in self._fsdp_params:
            if fp.sharded_param.is_meta:
                raise ValueError(f"parameter {fp._param_fqn!r} is on the meta device: materialise the stage "
                                 "before its gradient buckets are made")
            if tuple(fp.sharded_size) != tuple(fp.sharded_param.shape):
                raise ValueError(f"parameter {fp._param_fqn!r} is sharded ({tuple(fp.sharded_size)} of "
                                 f"{tuple(fp.sharded_param.shape)}): the replica reduction needs shard degree 1")
        self.group = group if group is not None and group.size() > 1 else None
        self.passes = passes
        self._buckets, self._slots = self._plan(bucket_bytes)
        self._next = 0  # the next bucket to launch (index order on every rank)
        self._hooked: dict[int, _Hooked] = {}
        self._started = False
        fsdp_group.reduce_grads = fsdp_group.all_reduce_grads = False
        # The stage's own flag setter (PipelineStage and the user's loop call it) must
        # never switch FSDP's reduction back on: it is this object's.
        ref = weakref.ref(self)
        fsdp_ref = weakref.ref(fsdp_group)

        def no_fsdp_sync(value: bool, *, recurse: bool = True) -> None:
            g = fsdp_ref()
            if g is not None:
                g.reduce_grads = g.all_reduce_grads = False

        object.__setattr__(module, "set_requires_gradient_sync", no_fsdp_sync)
        self._forward_hook = module.register_forward_hook(lambda *_: _call(ref, "arm"))

    def _plan(self, bucket_bytes: int) -> tuple[list[_Bucket], list[_Slot]]:
        """Buckets over the parameters in reverse order, split at ``bucket_bytes`` and at
        a change of dtype or device; one flat buffer each, kept for the generation."""
        groups: list[list[int]] = []
        size = 0
        for i in reversed(range(len(self._fsdp_params))):
            p = self._fsdp_params[i].sharded_param
            nbytes = p.numel() * p.element_size()
            last = self._fsdp_params[groups[-1][-1]].sharded_param if groups else None
            if (last is None or size + nbytes > bucket_bytes or last.dtype != p.dtype
                    or last.device != p.device):
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += nbytes
        buckets: list[_Bucket] = []
        slots: list[_Slot | None] = [None] * len(self._fsdp_params)
        for b, members in enumerate(groups):
            first = self._fsdp_params[members[0]].sharded_param
            buf = torch.empty(sum(self._fsdp_params[i].sharded_param.numel() for i in members),
                              dtype=first.dtype, device=first.to_local().device)
            off = 0
            for i in members:
                shape = self._fsdp_params[i].sharded_param.shape
                n = self._fsdp_params[i].sharded_param.numel()
                slots[i] = _Slot(b, buf[off:off + n].view(shape))
                off += n
            buckets.append(_Bucket(buf, members))
        return buckets, slots  # type: ignore[return-value]

    def buffers(self) -> list[Tensor]:
        """The buckets' flat buffers (for tests: gradients are views of them)."""
        return [b.buffer for b in self._buckets]

    # ------------------------------------------------------------ per iteration
    def arm(self) -> None:
        """Hook FSDP's unsharded parameters not hooked yet (they exist once the stage
        has run a forward; FSDP keeps the same objects for the generation)."""
        for i, fp in enumerate(self._fsdp_params):
            p = getattr(fp, "_unsharded_param", None)
            if p is None:
                continue
            h = self._hooked.get(i)
            if h is not None and h.param is p:
                continue
            if h is not None:
                h.handle.remove()
            ref = weakref.ref(self)
            handle = p.register_post_accumulate_grad_hook(lambda q, i=i: _call(ref, "_ready", i, q))
            self._hooked[i] = _Hooked(p, handle)

    def _ready(self, i: int, param: Tensor) -> None:
        """A backward pass accumulated ``param``'s gradient; at the last pass, into the bucket."""
        if not self._started:
            self._begin()
        slot = self._slots[i]
        slot.passes += 1
        if slot.passes == self.passes and not slot.copied:
            self._copy(i, param)
            self._launch_ready()

    def _begin(self) -> None:
        """The iteration's first gradient: a gradient still held from the last one is a
        view of a bucket about to be overwritten, so it gets its own memory."""
        self._started = True
        for i, fp in enumerate(self._fsdp_params):
            g = fp.sharded_param.grad
            if g is not None and g._local_tensor.untyped_storage().data_ptr() == \
                    self._buckets[self._slots[i].bucket].buffer.untyped_storage().data_ptr():
                fp.sharded_param.grad = fp.to_sharded_dtensor(g._local_tensor.clone())

    def _copy(self, i: int, param: Tensor) -> None:
        slot = self._slots[i]
        grad = param.grad
        with torch.no_grad():
            if grad is None:
                slot.view.zero_()
            else:
                slot.view.copy_(grad)
        slot.has_grad = grad is not None
        slot.copied = True
        param.grad = None  # as FSDP drops the unsharded gradient once it is copied in
        self._buckets[slot.bucket].filled += 1

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if b.filled < len(b.members):
                return
            if self.group is not None:
                b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)
            self._next += 1

    def finish(self) -> None:
        """After the iteration's last backward (FSDP has resharded): fill and launch what
        is left, wait for every bucket, then set each parameter's gradient to its
        reduced slot (added to a gradient it still holds, as FSDP does)."""
        if not self._started:
            self._begin()
        for i, fp in enumerate(self._fsdp_params):
            slot = self._slots[i]
            p = getattr(fp, "_unsharded_param", None)
            late = p is not None and p.grad is not None
            if slot.copied and late:
                raise RuntimeError(f"parameter {fp._param_fqn!r}: a gradient was accumulated after its bucket "
                                   "was reduced (more backward passes than the iteration's micro-batches)")
            if not slot.copied:
                if p is None:
                    self._mark_empty(i)
                else:
                    self._copy(i, p)
        self._launch_ready()
        for b in self._buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        for i, fp in enumerate(self._fsdp_params):
            slot = self._slots[i]
            if not slot.has_grad:
                continue
            sp = fp.sharded_param
            if sp.grad is not None:
                sp.grad._local_tensor += slot.view
            else:
                sp.grad = fp.to_sharded_dtensor(slot.view)
        self._clear()

    def _mark_empty(self, i: int) -> None:
        slot = self._slots[i]
        with torch.no_grad():
            slot.view.zero_()
        slot.has_grad = False
        slot.copied = True
        self._buckets[slot.bucket].filled += 1

    def _clear(self) -> None:
        for s in self._slots:
            s.passes, s.copied, s.has_grad = 0, False, False
        for b in self._buckets:
            b.filled, b.work = 0, None
        self._next = 0
        self._started = False

    def reset(self) -> None:
        """Drop an iteration that did not finish (rolled back, or its collectives
        failed): counts, pending reductions (not waited for: their group may be dead)
        and the unsharded gradients the passes so far left."""
        for h in self._hooked.values():
            h.param.grad = None
        self._clear()

    def close(self) -> None:
        """Remove every hook and let go of the group (the generation ends)."""
        for h in self._hooked.values():
            h.handle.remove()
        self._hooked.clear()
        self._forward_hook.remove()
        self._clear()
        self.group = None
        self._fsdp_params = []
        self._buckets, self._slots = [], []


def _call(ref: Callable[[], ReplicaReducer | None], name: str, *args: object) -> None:
    """Hooks hold the reducer weakly: a stage object outliving its generation (FSDP's,
    see engine.py) must not keep the reducer's process group alive."""
    r = ref()
    if r is not None:
        getattr(r, name)(*args)
