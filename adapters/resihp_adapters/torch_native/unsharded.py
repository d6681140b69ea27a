"""A shard-degree-1 FSDP stage's unsharded parameters as views of its sharded ones.

On a stage whose FSDP shard group has one rank (pure replicas, or one replica), FSDP2
still copies every parameter into a separate unsharded buffer before each forward and
frees that buffer after the backward: a copy of the whole stage, and a fresh allocation
(page faults on the host) every time (docs/benchmarks.md, "Where a fault-free
iteration goes"). With one rank in the shard group the unsharded parameter is the
sharded one, element for element (no padding, no other rank's part), so
:func:`alias_unsharded` makes FSDP's all-gather output the sharded data itself: FSDP's
copy then copies a tensor onto itself (which torch skips) and its free is skipped for
that parameter. The stage keeps FSDP's layout (sharded DTensors outside the forward and
backward: optimizer state, snapshots, DCP checkpoints and resharding see no change), and
the forward reads the same bits it read from the copy.

A parameter is aliased only where the copy would be bit-for-bit the sharded data: the
same dtype (no mixed-precision cast), no CPU offload, no all-gather extension, a
storage holding exactly the parameter. Whenever FSDP's sharded data is replaced (a
state dict loaded with ``assign``, FSDP's lazy re-initialisation) the old view is no
longer that data: FSDP's own copy-and-free runs for it from then on, as without this
module.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

__all__ = ["alias_unsharded", "aliased"]


def _source(fp: object) -> Tensor | None:
    """The sharded flat data FSDP's world-size-1 unshard copies from, when that copy
    is the identity (else None: FSDP's path is kept)."""
    data = getattr(fp, "_sharded_param_data", None)
    if (data is None or getattr(fp, "offload_to_cpu", False) or getattr(fp, "is_dtensor", False)
            or hasattr(getattr(fp, "_sharded_local_tensor", None), "fsdp_pre_all_gather")):
        return None
    # FSDP sets ``param_dtype`` only at its lazy initialisation: the policy decides
    policy = getattr(getattr(fp, "mp_policy", None), "param_dtype", None)
    if policy not in (None, data.dtype) or getattr(fp, "param_dtype", None) not in (None, data.dtype):
        return None  # a cast: the unsharded parameter is another tensor
    if data.storage_offset() or data.untyped_storage().nbytes() != data.numel() * data.element_size():
        return None  # FSDP resizes the output's storage: it must be this tensor's alone
    if tuple(getattr(fp, "_orig_size", ())) != tuple(fp._sharded_local_tensor.shape):
        return None  # padded, or not the whole parameter
    return data


def aliased(fp: object) -> bool:
    """True while ``fp``'s unsharded buffer is its sharded data (no copy, no free)."""
    data = getattr(fp, "_sharded_param_data", None)
    outs = getattr(fp, "all_gather_outputs", None)
    return (data is not None and bool(outs) and outs[0].data_ptr() == data.data_ptr()
            and outs[0].numel() == data.numel() and outs[0].dtype == data.dtype and _source(fp) is not None)


def alias_unsharded(group: object) -> int:
    """Make ``group``'s (an ``FSDPParamGroup`` whose shard group has one rank)
    unsharded parameters views of its sharded data; returns how many parameters are
    aliased. Raises ValueError if the group shards over more than one rank."""
    pg = getattr(group, "_all_gather_process_group", None)
    mesh_info = getattr(group, "mesh_info", None)
    size = getattr(mesh_info, "shard_mesh_size", None)
    if size is None and pg is not None:
        size = pg.size()
    if size != 1:
        raise ValueError(f"alias_unsharded: the FSDP group shards over {size} ranks, not 1")
    count = 0
    for fp in group.fsdp_params:
        src = _source(fp)
        if src is None or hasattr(fp, "_unsharded_param") or fp.all_gather_outputs:
            continue  # FSDP made its own buffer already (or must): keep its path
        fp.all_gather_outputs = [src]  # init_all_gather_outputs keeps a non-empty list
        fp.free_unsharded_param = _keep_if_aliased(fp, fp.free_unsharded_param)
        count += 1
    return count


def _keep_if_aliased(fp: object, free: Callable[[], None]) -> Callable[[], None]:
    def free_unless_aliased() -> None:
        if not aliased(fp):
            free()  # the sharded data was replaced: the old buffer is FSDP's own again
    return free_unless_aliased
