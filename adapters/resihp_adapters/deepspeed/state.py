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
from dataclasses import dataclass
from typing import Any, Iterable

from resihp_core.adapter import StateLost
from resihp_core.plan import ParallelPlan

__all__ = ["LayersLost", "Transfer", "transfer_plan", "layers_of", "extract_layers", "apply_layers",
           "pack", "unpack", "check_zero_stage", "exchange_layers"]


class LayersLost(StateLost):
    """No surviving rank holds some layer's state: restore from a checkpoint (the
    contract's state-lost signal, which the supervisor acts on)."""

    def __init__(self, missing: dict[int, list[int]]) -> None:
        self.missing = missing
        where = "; ".join(f"device {d}: layers {ls}" for d, ls in sorted(missing.items()))
        super().__init__(f"no survivor holds the state these devices need ({where}); restore from a checkpoint")


@dataclass(frozen=True)
class Transfer:
    """Layer ``layer`` goes from device ``src`` to device ``dst``."""

    layer: int
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


def transfer_plan(old: ParallelPlan | None, new: ParallelPlan, have_state: Iterable[int]) -> list[Transfer]:
    """Every layer move ``new`` needs. ``have_state`` are the devices that still hold
    their ``old`` state and are in ``new``'s world (senders must be in the new world).
    A device keeps the layers it already holds; others get each layer from a holder
    (rotated by layer index to spread the load). Raises :class:`LayersLost`."""
    if old is None:
        return []
    holders: dict[tuple[int, int], list[int]] = {}
    have = set(have_state)
    for d in sorted(have):
        held = layers_of(old, d)
        if held is None or new.location(d) is None:
            continue
        rng, t = held
        for layer in rng:
            holders.setdefault((layer, t), []).append(d)
    out: list[Transfer] = []
    missing: dict[int, list[int]] = {}
    for d in new.devices():
        rng, t = layers_of(new, d)  # type: ignore[misc]
        mine = layers_of(old, d) if d in have else None
        for layer in rng:
            if mine is not None and layer in mine[0] and mine[1] == t:
                continue
            cands = holders.get((layer, t))
            if not cands:
                missing.setdefault(d, []).append(layer)
                continue
            out.append(Transfer(layer, cands[layer % len(cands)], d))
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


# ------------------------------------------------------------- per-layer state
def extract_layers(engine: Any) -> dict[int, dict[str, Any]]:
    """Global layer index -> {"params": {name: tensor}, "opt": {name: optimizer state}}
    for this rank's layers (copies, so the engine can be dropped)."""
    opt = engine.basic_optimizer
    out: dict[int, dict[str, Any]] = {}
    for idx, mod in engine.module.local_layers().items():
        params, ostate = {}, {}
        for name, p in mod.named_parameters():
            params[name] = p.detach().clone()
            st = opt.state.get(p)
            if st:
                ostate[name] = {k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in st.items()}
        out[idx] = {"params": params, "opt": ostate}
    return out


def apply_layers(engine: Any, layers: dict[int, dict[str, Any]]) -> None:
    """Load extracted layer state into ``engine`` (its optimizer state included)."""
    import torch

    opt = engine.basic_optimizer
    local = engine.module.local_layers()
    for idx, st in layers.items():
        mod = local.get(idx)
        if mod is None:
            raise KeyError(f"layer {idx} is not held by this rank (holds {sorted(local)})")
        named = dict(mod.named_parameters())
        if set(named) != set(st["params"]):
            raise KeyError(f"layer {idx}: parameters {sorted(st['params'])} do not match {sorted(named)}")
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(st["params"][name])
                if name in st["opt"]:
                    opt.state[p] = {k: (v.clone() if hasattr(v, "clone") else v) for k, v in st["opt"][name].items()}
                else:
                    opt.state.pop(p, None)


def pack(obj: Any):
    """Serialise layer state into a uint8 tensor for point-to-point transfer."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(t: Any) -> Any:
    import torch

    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)


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
        payload = pack({i: mine[i] for i in layers})
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
        if sorted(got) != sorted(layers):
            raise RuntimeError(f"device {device}: expected layers {layers} from device {src}, got {sorted(got)}")
        received.update(got)
    for w in works:
        p2p_wait(w)
    return received, nbytes
