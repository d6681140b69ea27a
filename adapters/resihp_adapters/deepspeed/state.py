"""Parameters and optimizer state by global layer index, and the plan for moving them.

DeepSpeed names a pipeline layer's parameters by the layer's global index
(``"4.fc.weight"``), independent of how layers are cut into stages, so a layer's state
can be taken out of one engine and put into another built for a different plan: layer
repartition, a dropped replica, a standby that joins. :func:`transfer_plan` decides, the
same way on every rank, which surviving rank sends each layer a rank now needs; a layer
no survivor holds means the state must come from a checkpoint (:class:`LayersLost`).
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Union

from resihp_core.adapter import StateLost
from resihp_core.plan import ParallelPlan

__all__ = ["LayersLost", "Transfer", "transfer_plan", "layers_of", "units_of", "extract_units", "apply_units",
           "extract_layers", "apply_layers", "unit_keys", "unit_name", "tied_layers", "GLOBAL", "zero_grads",
           "pack", "unpack", "check_zero_stage", "exchange_layers", "ShardsLost", "ShardsMissing",
           "merge_units", "zero_full_state", "is_sharded", "snapshot_units"]

#: A piece of state that moves as a whole: a global layer index, a tied group
#: (``"tied.<key>"``) or :data:`GLOBAL`.
Unit = Union[int, str]


class ShardsLost(StateLost):
    """ZeRO 1: some elements of the optimizer state a rank needs were held only by a
    rank that died (raised on every rank alike, after the exchange)."""


class LayersLost(StateLost):
    """No surviving rank holds some layer's state: restore from a checkpoint (the
    contract's state-lost signal, which the supervisor acts on)."""

    def __init__(self, missing: dict[int, list[Any]]) -> None:
        self.missing = missing
        where = "; ".join(f"device {d}: layers {[u for u in ls if isinstance(u, int)]}"
                          + "".join(f", {u}" for u in ls if not isinstance(u, int))
                          for d, ls in sorted(missing.items()))
        super().__init__(f"no survivor holds the state these devices need ({where}); restore from a checkpoint")


@dataclass(frozen=True)
class Transfer:
    """Unit ``layer`` (a global layer index, a tied group or :data:`GLOBAL`) goes from
    device ``src`` to device ``dst``."""

    layer: Unit
    src: int
    dst: int


def layers_of(plan: ParallelPlan, device: int) -> tuple[range, int] | None:
    """(layer range, TP index) ``device`` holds in ``plan``, or None."""
    loc = plan.location(device)
    if loc is None:
        return None
    _, s, t = loc
    a, b = plan.layer_ranges[s]
    return range(a, b), t


def units_of(plan: ParallelPlan, device: int, tied: Mapping[str, set[int]] | None = None) -> tuple[list[Unit], int] | None:
    """The units ``device`` holds in ``plan`` (its layers, the tied groups any of them
    uses, :data:`GLOBAL`) and its TP index; None for a device the plan leaves out."""
    held = layers_of(plan, device)
    if held is None:
        return None
    rng, t = held
    units: list[Unit] = list(rng)
    units += sorted(tied_unit(k) for k, idx in (tied or {}).items() if set(rng) & set(idx))
    return units + [GLOBAL], t


def _spread(key: Unit) -> int:
    return key if isinstance(key, int) else zlib.crc32(str(key).encode())


def _order(key: Unit) -> tuple[int, int, str]:
    return (0, key, "") if isinstance(key, int) else (1, 0, str(key))


def transfer_plan(old: ParallelPlan | None, new: ParallelPlan, have_state: Iterable[int],
                  tied: Mapping[str, set[int]] | None = None, *, sharded: bool = False) -> list[Transfer]:
    """Every unit move ``new`` needs. ``have_state`` are the devices that still hold
    their ``old`` state and are in ``new``'s world (senders must be in the new world).
    A device keeps the units it already holds; others get each unit from a holder
    (rotated by unit to spread the load). ``tied``: tie key -> layer indices (a tied
    group is held by every stage with one of its layers). ``sharded`` (ZeRO 1: each
    holder has only its fragment of a unit's optimizer state): a device gets every
    layer and tied unit from *every* surviving holder but itself, and keeps its own
    fragment too. Raises :class:`LayersLost`."""
    if old is None:
        return []
    holders: dict[tuple[Unit, int], list[int]] = {}
    have = set(have_state)
    for d in sorted(have):
        held = units_of(old, d, tied)
        if held is None or new.location(d) is None:
            continue
        units, t = held
        for u in units:
            holders.setdefault((u, t), []).append(d)
    out: list[Transfer] = []
    missing: dict[int, list[Unit]] = {}
    for d in new.devices():
        units, t = units_of(new, d, tied)  # type: ignore[misc]
        mine = units_of(old, d, tied) if d in have else None
        for u in units:
            kept = mine is not None and u in mine[0] and mine[1] == t
            cands = holders.get((u, t))
            if sharded and u != GLOBAL:
                if not cands:
                    missing.setdefault(d, []).append(u)
                out += [Transfer(u, h, d) for h in cands or () if h != d]
                continue
            if kept:
                continue
            if not cands:
                missing.setdefault(d, []).append(u)
                continue
            out.append(Transfer(u, cands[_spread(u) % len(cands)], d))
    if missing:
        raise LayersLost(missing)
    return out


def check_zero_stage(stage: int, *, moving_state: bool) -> None:
    """ZeRO 1 partitions optimizer state over the DP ranks of a stage: a dead rank's
    shard is gone and DeepSpeed cannot re-partition it in place. Refuse clearly."""
    if stage >= 1 and moving_state:
        raise RuntimeError(
            f"zero_optimization.stage={stage} partitions the optimizer state across data-parallel "
            "ranks, so it cannot be moved to a new plan generation in place; use stage 0 for "
            "recovery without a checkpoint, or restore from a checkpoint"
        )


# ------------------------------------------------------------- per-unit state
#: The unit every rank holds: optimizer hyperparameters per parameter group (the LR the
#: scheduler set), the LR scheduler's own state and the engine's step counters.
GLOBAL = "global"


def tied_unit(key: str) -> str:
    """Unit name of a ``TiedLayerSpec`` group (one copy per tied group)."""
    return f"tied.{key}"


def unit_name(key: Unit) -> str:
    """File-safe, layout-independent name of a unit (``layer_0003``, ``tied.embed``, ``global``)."""
    return f"layer_{key:04d}" if isinstance(key, int) else str(key)


def tied_layers(engine_or_module: Any) -> dict[str, set[int]]:
    """Tie key -> global indices of the layers that use it (the whole model's, from the
    module's layer specs, so the same on every rank)."""
    module = getattr(engine_or_module, "module", engine_or_module)
    return tied_of_specs(getattr(module, "_layer_specs", []))


def tied_of_specs(specs: Iterable[Any]) -> dict[str, set[int]]:
    """:func:`tied_layers` from the model's layer specs alone (no engine needed)."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    out: dict[str, set[int]] = {}
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            out.setdefault(spec.key, set()).add(idx)
    return out


def unit_keys(engine: Any) -> list[Unit]:
    """The units this rank's engine holds: its layers (a layer without parameters, or a
    tied one, is an empty unit), its tied groups and :data:`GLOBAL`."""
    module = engine.module
    keys: list[Unit] = list(range(module._local_start, module._local_stop))
    keys += sorted(tied_unit(k) for k in getattr(module, "tied_modules", {}))
    return keys + [GLOBAL]


def _unit_module(engine: Any, key: Unit) -> Any:
    if isinstance(key, int):
        if hasattr(engine.module, "local_layers"):
            return engine.module.local_layers().get(key)
        import torch  # DeepSpeed's own PipelineModule (plain launches) names layers the same way

        mod = getattr(engine.module, str(key), None)
        return mod if isinstance(mod, torch.nn.Module) else None
    if key.startswith("tied."):
        return engine.module.tied_modules[key[len("tied."):]] if key[len("tied."):] in engine.module.tied_modules \
            else None
    return None


def _bf16(engine: Any) -> Any:
    """DeepSpeed's ``BF16_Optimizer`` wrapping the engine's optimizer, or None."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return engine.optimizer if isinstance(engine.optimizer, BF16_Optimizer) else None


def _master_slots(bf: Any) -> dict[int, tuple[int, int, int]]:
    """id(bf16 parameter) -> (param group, start, numel) of its fp32 master weights in
    that group's flat fp32 tensor (the engine keeps it whole: ``docs/deepspeed.md``)."""
    out = {}
    for gi, group in enumerate(bf.bf16_groups):
        for p in group:
            addr = p._hp_mapping.get_hp_fragment_address()
            if addr.numel != p.numel():
                raise RuntimeError("the bf16 master weights are partitioned; ResiHP's engine keeps them whole")
            out[id(p)] = (gi, int(addr.start), int(addr.numel))
    return out


# ------------------------------------------------------------------- ZeRO stage 1
# DeepSpeed's ZeRO 1 optimizer keeps, per parameter group, one flat master-weight
# partition per data-parallel rank (``single_partition_of_fp32_groups``) and the inner
# optimizer's state for that flat tensor. Which elements of a parameter a rank holds is
# DeepSpeed's own ``param._hp_mapping`` (flattened parameter offsets -> flat partition
# offsets). A unit's ZeRO state is therefore a list of fragments, one per holder; a rank
# of another layout takes the elements its own partition needs from whichever fragments
# cover them (docs/deepspeed.md, ZeRO).

class ShardsMissing(RuntimeError):
    """The fragments given do not cover the elements this rank's partition needs."""


def is_sharded(engine: Any) -> bool:
    """True when the engine's optimizer state is partitioned (DeepSpeed's ZeRO 1)."""
    return _zero(engine) is not None


def _zero(engine: Any) -> Any:
    """DeepSpeed's ZeRO stage 1/2 optimizer wrapping the engine's optimizer, or None."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return engine.optimizer if isinstance(engine.optimizer, DeepSpeedZeroOptimizer) else None


def _zero_flat(zero: Any, p: Any) -> Any:
    return zero.single_partition_of_fp32_groups[p._hp_mapping.param_group_index]


def _zero_fragments(zero: Any, p: Any, take: Callable[[Any], Any] | None = None) -> list[dict[str, Any]]:
    """This rank's fragment of ``p``'s master weights and optimizer state (empty when
    its partition holds none of ``p``): ``{"start", "numel", "master", "opt"}`` with
    offsets into the flattened parameter; ``opt`` holds the group's step count too.
    ``take`` makes each value's copy (:func:`_clone`, the default)."""
    take = take or _clone
    m = getattr(p, "_hp_mapping", None)
    if m is None:
        return []
    a, n = int(m.hp_fragment_address.start), int(m.hp_fragment_address.numel)
    flat = _zero_flat(zero, p)
    st = zero.optimizer.state.get(flat) or {}
    opt = {k: take(v.detach().narrow(0, a, n) if hasattr(v, "dim") and v.dim() > 0 else v) for k, v in st.items()}
    return [{"start": int(m.lp_fragment_address.start), "numel": int(m.lp_fragment_address.numel),
             "master": take(flat.detach().narrow(0, a, n)), "opt": opt}]


def _apply_zero_fragments(zero: Any, p: Any, frags: list[dict[str, Any]], what: str) -> None:
    """Write the elements of ``p`` this rank's partition holds from ``frags`` (any
    layout's fragments); raises :class:`ShardsMissing` when they do not cover them."""
    import torch

    m = getattr(p, "_hp_mapping", None)
    if m is None:
        return
    lo, n = int(m.lp_fragment_address.start), int(m.lp_fragment_address.numel)
    a = int(m.hp_fragment_address.start)
    flat = _zero_flat(zero, p)
    covered = torch.zeros(n, dtype=torch.bool)
    keys = None
    for f in frags:
        s, e = max(lo, f["start"]), min(lo + n, f["start"] + f["numel"])
        if s >= e:
            continue
        covered[s - lo:e - lo] = True
        flat.detach().narrow(0, a + s - lo, e - s).copy_(f["master"].narrow(0, s - f["start"], e - s))
        tensors = {k: v for k, v in f["opt"].items() if hasattr(v, "dim") and v.dim() > 0}
        if keys is None:
            keys = set(f["opt"])
            if not tensors:
                zero.optimizer.state.pop(flat, None)  # no step taken yet: no state
                zero._hp_optimizer_states_linked = False
            else:
                st = zero.optimizer.state.setdefault(flat, {})
                for k, v in f["opt"].items():
                    if k in tensors:
                        if k not in st:
                            st[k] = torch.zeros_like(flat, dtype=v.dtype)
                    else:
                        st[k] = _clone(v)
        for k, v in tensors.items():
            zero.optimizer.state[flat][k].narrow(0, a + s - lo, e - s).copy_(v.narrow(0, s - f["start"], e - s))
    if not bool(covered.all()):
        raise ShardsMissing(f"{what}: {int((~covered).sum())} of the {n} elements this rank's ZeRO partition "
                            "needs are in no surviving shard")


def merge_units(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One unit's state from two holders: ``a``'s, plus ``b``'s ZeRO fragments."""
    if "zero" not in a or "zero" not in b:
        return a
    return {**a, "zero": {n: a["zero"].get(n, []) + b["zero"].get(n, []) for n in a["zero"]}}


def zero_full_state(engine: Any) -> dict[str, Any]:
    """Under ZeRO 1: every parameter's whole master weights and optimizer state,
    gathered over its stage's data-parallel ranks (a collective: every rank of the
    generation calls it, as DeepSpeed's own ``safe_get_full_optimizer_state``)."""
    import torch

    from resihp_adapters.deepspeed.engine import all_reduce

    zero = _zero(engine)
    out: dict[str, Any] = {}
    if zero is None:
        return out
    flats = zero.single_partition_of_fp32_groups
    keys = sorted({k for f in flats for k, v in (zero.optimizer.state.get(f) or {}).items()
                   if hasattr(v, "dim") and v.dim() > 0})
    step = next((v for f in flats for k, v in (zero.optimizer.state.get(f) or {}).items() if k == "step"), None)
    for key in unit_keys(engine):
        if key == GLOBAL:
            continue
        mod = _unit_module(engine, key)
        for name, p in (mod.named_parameters() if mod is not None else ()):
            full = param_name(key, name)
            m = getattr(p, "_hp_mapping", None)
            for k in [None, *keys]:
                buf = torch.zeros(p.numel(), dtype=flats[0].dtype)
                if m is not None:
                    src = _zero_flat(zero, p) if k is None else zero.optimizer.state[_zero_flat(zero, p)][k]
                    buf.narrow(0, int(m.lp_fragment_address.start), int(m.lp_fragment_address.numel)).copy_(
                        src.detach().narrow(0, int(m.hp_fragment_address.start), int(m.hp_fragment_address.numel)))
                all_reduce(buf, group=zero.dp_process_group)
                if k is None:
                    if p.dtype != buf.dtype:
                        out[f"master.{full}"] = buf.view_as(p)
                else:
                    out[f"optimizer.{full}.{k}"] = buf.view_as(p)
            if step is not None:
                out[f"optimizer.{full}.step"] = _clone(step)
    return out


def _clone(v: Any) -> Any:
    return v.detach().clone() if hasattr(v, "detach") else v


def _own(v: Any) -> Any:
    """A copy the engine may keep and change: tensors cloned, containers copied (so a
    rollback snapshot, kept after it is applied, is never changed through the engine)."""
    import copy

    if hasattr(v, "detach"):
        return v.detach().clone()
    return copy.deepcopy(v) if isinstance(v, (list, dict, tuple)) else v


def _detached(v: Any) -> Any:
    return v.detach() if hasattr(v, "detach") else v


def extract_units(engine: Any, *, copy: bool = True) -> dict[Unit, dict[str, Any]]:
    """Copies of every unit this rank holds (:func:`unit_keys`), so the engine can be
    dropped. A layer or tied group: ``{"params": {name: tensor}, "opt": {name: {key:
    state}}}`` plus, with bf16, ``"master": {name: fp32 tensor}`` (the optimizer state
    is then the master weights' slice of it, and ``step`` its group's step count).
    :data:`GLOBAL`: optimizer hyperparameters per group, LR scheduler state, counters.
    ``copy=False``: the same structure over the engine's own tensors (detached views),
    for :func:`snapshot_units` to copy into buffers it already has."""
    take = _clone if copy else _detached
    opt = engine.basic_optimizer
    bf = _bf16(engine)
    slots = _master_slots(bf) if bf is not None else {}
    zero = _zero(engine)
    # FusedAdam: one step count per group, written into the copy (the group's and every
    # parameter's), so the state is the same whichever parameter advanced it.
    steps = _group_steps(opt) if _shares_group_step(opt) else None
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    out: dict[Unit, dict[str, Any]] = {}
    for key in unit_keys(engine):
        if key == GLOBAL:
            sched = getattr(engine, "lr_scheduler", None)
            groups = [{k: take(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            for g, n in zip(groups, steps or ()):
                g["step"] = n
            out[key] = {
                "groups": groups,
                "lr_scheduler": _sched_state(sched, take),
                "counters": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                             "skipped_steps": int(getattr(engine, "skipped_steps", 0))},
            }
            continue
        mod = _unit_module(engine, key)
        params, ostate, master = {}, {}, {}
        if zero is not None:
            named = list(mod.named_parameters()) if mod is not None else []
            out[key] = {"params": {n: take(p) for n, p in named}, "opt": {},
                        "zero": {n: _zero_fragments(zero, p, take) for n, p in named}}
            continue
        for name, p in (mod.named_parameters() if mod is not None else ()):
            params[name] = take(p)
            if bf is not None:
                gi, a, n = slots[id(p)]
                flat = bf.fp32_groups_flat_partition[gi]
                master[name] = take(flat.detach().narrow(0, a, n).view_as(p))
                st = opt.state.get(flat)
                if st:
                    ostate[name] = {k: take(v.detach().narrow(0, a, n).view_as(p)
                                            if hasattr(v, "dim") and v.dim() > 0 else v) for k, v in st.items()}
            else:
                st = opt.state.get(p)
                if st:
                    ostate[name] = {k: take(v) for k, v in st.items()}
                    if steps is not None and "step" in st:
                        ostate[name]["step"] = steps[group_of[id(p)]]
        out[key] = {"params": params, "opt": ostate, **({"master": master} if bf is not None else {})}
    return out


def snapshot_units(engine: Any, reuse: dict[Unit, dict[str, Any]] | None = None, *,
                   device: str | None = None) -> dict[Unit, dict[str, Any]]:
    """:func:`extract_units`'s copies, written into the tensors of ``reuse`` where it
    holds tensors of the same shapes and dtypes in the same order (an earlier snapshot
    of this rank that nobody else holds any more); otherwise fresh copies. The values
    are :func:`extract_units`'s exactly; the rollback snapshot taken before every
    iteration then reuses its buffers instead of allocating (and faulting in) the
    stage's whole state afresh each time. ``device``: where the copies live (``"cpu"``
    for a checkpoint's host staging); None: beside the engine's tensors."""
    import torch

    live = extract_units(engine, copy=False)
    src = _tensor_leaves(live, [])
    dst = _tensor_leaves(reuse, []) if reuse is not None else []
    where = (lambda s: s.device) if device is None else (lambda s: torch.device(device))
    if len(dst) == len(src) and all(d.shape == s.shape and d.dtype == s.dtype and d.device == where(s)
                                    and d.stride() == s.stride() for d, s in zip(dst, src)):
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
    else:
        dst = [s.detach().clone() if device is None else s.detach().to(device, copy=True) for s in src]
    return _refill(live, iter(dst))


def _tensor_leaves(tree: Any, out: list[Any]) -> list[Any]:
    """The tensors of a unit tree (dicts, lists and tuples), depth first."""
    import torch

    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif type(tree) is dict:
        for v in tree.values():
            _tensor_leaves(v, out)
    elif type(tree) in (list, tuple):
        for v in tree:
            _tensor_leaves(v, out)
    return out


def _refill(tree: Any, tensors: Iterator[Any]) -> Any:
    """``tree`` with its tensors replaced, in :func:`_tensor_leaves`'s order, by ``tensors``."""
    import torch

    if isinstance(tree, torch.Tensor):
        return next(tensors)
    if type(tree) is dict:
        return {k: _refill(v, tensors) for k, v in tree.items()}
    if type(tree) is list:
        return [_refill(v, tensors) for v in tree]
    if type(tree) is tuple:
        return tuple(_refill(v, tensors) for v in tree)
    return tree


def _shares_group_step(opt: Any) -> bool:
    """True for DeepSpeed's ``FusedAdam``: its ``step()`` increments and uses the step
    count of the *last* parameter of a group that has a gradient, for the whole group
    (the other parameters' counts stay where they started), so which parameter counts
    depends on the layout. Carried as one count per group (:func:`_group_steps`)."""
    try:
        from deepspeed.ops.adam import FusedAdam
    except ImportError:  # pragma: no cover - DeepSpeed without its ops package
        return False
    return isinstance(opt, FusedAdam)


def _group_steps(opt: Any) -> list[int]:
    """Steps each parameter group of a ``FusedAdam`` has taken: the largest count among
    the group and its parameters' states (the one ``step()`` advanced)."""
    out = []
    for g in opt.param_groups:
        n = int(g.get("step", 0))
        for p in g["params"]:
            st = opt.state.get(p)
            if st and "step" in st:
                n = max(n, int(st["step"]))
        out.append(n)
    return out


def _set_group_steps(opt: Any, steps: list[int]) -> None:
    """Give every parameter of each group (and the group, from which ``FusedAdam``
    starts a new parameter's count) the group's step count, so the next step's bias
    correction is the fault-free run's whichever parameter is now the group's last."""
    for g, n in zip(opt.param_groups, steps):
        g["step"] = n
        for p in g["params"]:
            st = opt.state.get(p)
            if st and "step" in st:
                st["step"] = n


def _sched_state(sched: Any, take: Callable[[Any], Any] = _clone) -> dict[str, Any] | None:
    if sched is None:
        return None
    return {k: take(v) for k, v in sched.state_dict().items() if not callable(v)}


def apply_units(engine: Any, units: dict[Unit, dict[str, Any]]) -> None:
    """Load extracted units into ``engine`` (optimizer state, master weights, LR
    scheduler and counters included). A rank gets every unit it holds."""
    import torch

    opt = engine.basic_optimizer
    bf = _bf16(engine)
    slots = _master_slots(bf) if bf is not None else {}
    zero = _zero(engine)
    mine = set(unit_keys(engine))
    for key, st in units.items():
        if key not in mine:
            raise KeyError(f"unit {unit_name(key)} is not held by this rank (holds {[unit_name(k) for k in mine]})")
        if key == GLOBAL:
            _apply_global(engine, st)
            continue
        mod = _unit_module(engine, key)
        named = dict(mod.named_parameters()) if mod is not None else {}
        if set(named) != set(st["params"]):
            raise KeyError(f"{unit_name(key)}: parameters {sorted(st['params'])} do not match {sorted(named)}")
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(st["params"][name])
                if zero is not None:
                    _apply_zero_fragments(zero, p, st.get("zero", {}).get(name, []), f"{unit_name(key)}:{name}")
                    continue
                if bf is not None:
                    gi, a, n = slots[id(p)]
                    flat = bf.fp32_groups_flat_partition[gi]
                    flat.narrow(0, a, n).copy_(st["master"][name].reshape(-1))
                    saved = st["opt"].get(name)
                    if saved:
                        fst = opt.state[flat]
                        for k, v in saved.items():
                            if hasattr(v, "dim") and v.dim() > 0:
                                if k not in fst:
                                    fst[k] = torch.zeros_like(flat, dtype=v.dtype)
                                fst[k].narrow(0, a, n).copy_(v.reshape(-1))
                            else:
                                fst[k] = _clone(v)
                elif name in st["opt"]:
                    opt.state[p] = {k: _clone(v) for k, v in st["opt"][name].items()}
                else:
                    opt.state.pop(p, None)
    if _shares_group_step(opt):
        _set_group_steps(opt, _group_steps(opt))


def _apply_global(engine: Any, st: dict[str, Any]) -> None:
    groups = engine.basic_optimizer.param_groups
    if len(groups) != len(st["groups"]):
        raise KeyError(f"the optimizer has {len(groups)} parameter groups, the saved state {len(st['groups'])}")
    for g, saved in zip(groups, st["groups"]):
        for k, v in saved.items():
            g[k] = _own(v)
    sched = getattr(engine, "lr_scheduler", None)
    if (sched is None) != (st["lr_scheduler"] is None):
        raise KeyError("the saved state and this engine disagree on whether there is an LR scheduler")
    if sched is not None:
        cur = sched.state_dict()
        cur.update({k: _own(v) for k, v in st["lr_scheduler"].items()})
        sched.load_state_dict(cur)
    c = st["counters"]
    engine.global_steps, engine.global_samples = c["global_steps"], c["global_samples"]
    engine.skipped_steps = c["skipped_steps"]


def param_name(key: Unit, name: str) -> str:
    """DeepSpeed's own name of a unit's parameter (as in its module ``state_dict``):
    ``"3.fc.weight"``, ``"tied_modules.embed.weight"``."""
    if isinstance(key, int):
        return f"{key}.{name}"
    if key.startswith("tied."):
        return f"tied_modules.{key[len('tied.'):]}.{name}"
    raise ValueError(f"unit {key!r} has no parameters")


def flat_state(engine: Any) -> dict[str, Any]:
    """:func:`extract_units` flattened to ``{layout-independent name: tensor or value}``
    (the adapter's ``full_state``)."""
    out: dict[str, Any] = {}
    for key, st in extract_units(engine).items():
        if key == GLOBAL:
            for i, g in enumerate(st["groups"]):
                for k, v in g.items():
                    out[f"optimizer.param_groups.{i}.{k}"] = v
            for k, v in (st["lr_scheduler"] or {}).items():
                out[f"lr_scheduler.{k}"] = v
            for k, v in st["counters"].items():
                out[f"engine.{k}"] = v
            continue
        for name, p in st["params"].items():
            full = param_name(key, name)
            out[full] = p
            if "master" in st:
                out[f"master.{full}"] = st["master"][name]
            for k, v in st["opt"].get(name, {}).items():
                out[f"optimizer.{full}.{k}"] = v
    out.update(zero_full_state(engine))
    module = engine.module
    out["rng.seed_layers"] = bool(module.seed_layers)
    out["rng.base_seed"] = int(module.base_seed)
    return out


# Older names (the checkpoint code and the runner use them): every unit, not only layers.
extract_layers = extract_units
apply_layers = apply_units


def zero_grads(engine: Any) -> None:
    """Drop accumulated gradients of an iteration that will not be stepped (every
    optimizer DeepSpeed may wrap: torch's, ``BF16_Optimizer``, ``FusedAdam`` whose
    ``zero_grad`` takes no ``set_to_none``)."""
    opt = engine.optimizer
    try:
        opt.zero_grad(set_to_none=True)
    except TypeError:
        opt.zero_grad()
        for p in engine.module.parameters():
            p.grad = None


def pack(obj: Any):
    """Serialise layer state into a uint8 tensor for point-to-point transfer."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(t: Any) -> Any:
    import torch

    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True, map_location="cpu")


def exchange_layers(device: int, plan: ParallelPlan, transfers: list, mine: dict[int, Any]) -> tuple[dict[int, Any], int]:
    """Send and receive layer state in the new world, one bundle per (source, target)."""
    import torch
    import torch.distributed as tdist

    from resihp_adapters.deepspeed.engine import device_rank, p2p_wait

    out_b: dict[int, list[int]] = {}
    in_b: dict[int, list[int]] = {}
    for t in transfers:
        if t.src == device:
            out_b.setdefault(t.dst, []).append(t.layer)
        if t.dst == device:
            in_b.setdefault(t.src, []).append(t.layer)
    works, keep = [], []
    for dst, layers in sorted(out_b.items()):
        payload = pack({i: mine[i] for i in sorted(layers, key=_order)})
        n = torch.tensor([payload.numel()], dtype=torch.int64)
        peer = device_rank(plan, dst)
        keep += [payload, n]
        works += [tdist.isend(n, dst=peer), tdist.isend(payload, dst=peer)]
    received: dict[int, Any] = {}
    nbytes = 0
    for src, layers in sorted(in_b.items()):
        peer = device_rank(plan, src)
        n = torch.zeros(1, dtype=torch.int64)
        p2p_wait(tdist.irecv(n, src=peer))
        payload = torch.empty(int(n.item()), dtype=torch.uint8)
        p2p_wait(tdist.irecv(payload, src=peer))
        nbytes += payload.numel()
        got = unpack(payload)
        if sorted(got, key=_order) != sorted(layers, key=_order):
            raise RuntimeError(f"device {device}: expected units {layers} from device {src}, got {list(got)}")
        for u, st in got.items():  # ZeRO 1: one unit's fragments come from several holders
            received[u] = merge_units(received[u], st) if u in received else st
    for w in works:
        p2p_wait(w)
    return received, nbytes
