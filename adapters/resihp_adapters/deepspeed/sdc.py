"""Silent data corruption on the DeepSpeed adapter (docs/sdc.md): the fingerprint DP
replicas of a stage compare before an iteration commits, the range signal, and the
injected flips around DeepSpeed's optimizer step.

Fingerprints cover ZeRO stage 0 without bf16, where every replica of a stage steps the
same whole parameters with the same whole optimizer state. Under ZeRO 1 each replica
steps only its partition of the optimizer state and the parameters are gathered after
the step, and under bf16 the fp32 master weights live in DeepSpeed's flat partitions:
there the device posts no fingerprint (the range signal still runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from resihp_core.detector.sdc import Fingerprint, grad_norm, same_layout_replicas, tensor_digest

if TYPE_CHECKING:
    import torch

    from resihp_core.plan import ParallelPlan
    from resihp_core.runtime.worker.injector import FaultInjector

__all__ = ["comparable", "fingerprint", "SdcStep"]


def comparable(engine: Any) -> bool:
    """Whether replicas of this engine's stage hold bit-identical whole state after the
    step: ZeRO stage 0 and no bf16 master weights."""
    from resihp_adapters.deepspeed.state import _bf16, _zero

    return _zero(engine) is None and _bf16(engine) is None


def _named_state(engine: Any) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Parameters, and their optimizer-state tensors, by name, in a fixed order."""
    import torch

    opt = engine.basic_optimizer
    params: list[tuple[str, torch.Tensor]] = []
    state: list[tuple[str, torch.Tensor]] = []
    for name, p in engine.module.named_parameters():
        params.append((f"param.{name}", p.detach()))
        st = opt.state.get(p, {})
        state += [(f"{k}.{name}", st[k].detach()) for k in sorted(st)
                  if isinstance(st[k], torch.Tensor) and st[k].dim()]
    return params, state


def fingerprint(engine: Any, plan: ParallelPlan, device: int, step: int, share: float = 1.0,
                rounds: int = 1) -> Fingerprint | None:
    """This device's fingerprint after ``step`` optimizer steps (its parameters, at
    ``share``, and a ``1/rounds`` window of its optimizer state: ``tensor_digest``): the
    group is the stage's layer range with the TP rank and degree (every replica holding
    it steps the same reduced gradient); None where replicas do not hold the same whole state
    (:func:`comparable`), where no other replica holds the stage, or where the device
    runs nothing."""
    loc = plan.location(device)
    if engine is None or loc is None or not comparable(engine):
        return None
    r, s, t = loc
    if same_layout_replicas(plan, r, s) < 2:
        return None  # nothing to compare with (the range signal still runs)
    a, b = plan.layer_ranges[s]
    params, state = _named_state(engine)
    return Fingerprint(f"stage{s}/layers{a}-{b}/tp{t}of{plan.degree(r, s)}/step{step}",
                       tensor_digest(params, share=share, turn=step, state=state, rounds=rounds))


class SdcStep:
    """Wraps DeepSpeed's optimizer step (the engine's ``sdc_step`` hook): injected flips
    of the gradients before it and of the parameters and first optimizer moment after
    it (``FaultInjector.corrupt``), and the norm of the gradients it reads."""

    def __init__(self, faults: FaultInjector, watch_grads: bool) -> None:
        self.faults, self.watch_grads = faults, watch_grads
        self.grad_norm: float | None = None
        self.compared = False  # replicas compare this state: no range signal needed

    def build(self, engine: Any, plan: ParallelPlan, device: int) -> None:
        """A new engine for ``plan``: whether replicas compare its state from now on."""
        loc = plan.location(device)
        self.compared = loc is not None and comparable(engine) and same_layout_replicas(plan, loc[0], loc[1]) >= 2
        self.grad_norm = None

    def __call__(self, engine: Any, step: Callable[[], None]) -> None:
        named = dict(engine.module.named_parameters())
        self.faults.corrupt("grad", {n: p.grad for n, p in named.items() if p.grad is not None})
        if self.watch_grads and not self.compared:
            self.grad_norm = grad_norm(p.grad for p in named.values())
        step()
        self.faults.corrupt("param", {n: p.data for n, p in named.items()})
        opt = engine.basic_optimizer
        first = {}
        for n, p in named.items():
            st = opt.state.get(p, {})
            t = next((st[k] for k in sorted(st) if hasattr(st[k], "dim") and st[k].dim()), None)
            if t is not None:
                first[n] = t
        self.faults.corrupt("optimizer", first)
