"""What a rank without an engine answers for ``train_batch()`` and ``get_lr()`` (and
what a rank off the last stage returns from ``train_batch()``).

Under ZeRO 1 or bf16 a plan that keeps only part of a replica (one not planned by
``resihp launch``, which re-stages such a job into whole replicas) runs as its
whole-replica equivalent and the partial replica's ranks idle (docs/deepspeed.md, partial replicas):
they build no DeepSpeed engine in that generation, yet the user's loop on them goes on
calling ``train_batch()`` and ``engine.get_lr()[0]``. They answer what DeepSpeed's engine
answers on every rank:

- the loss: the committed iteration's global mean loss, the sum of the iteration's
  reports' losses (each last-stage executor reports its share; the others 0), which is
  the value DeepSpeed's ``train_batch`` broadcasts to every stage (ranks of the other
  stages return it too: the generation's engine leaves them 0.0);
- the learning rate: the scheduler of the state this rank held when it went idle
  (``GLOBAL`` unit: the optimizer's parameter groups, the LR scheduler's state and the
  step count), built again on a stand-in optimizer and stepped once per step committed
  since, as DeepSpeed steps it once per optimizer step.
"""

from __future__ import annotations

from typing import Any

from resihp_core.protocols.store import KeyValueStore

__all__ = ["committed_loss", "held_lr"]


def committed_loss(store: KeyValueStore, generation: int, iteration: int, devices: list[int]) -> float:
    """The global mean loss of committed ``iteration`` of ``generation`` from its reports."""
    from resihp_core.runtime import session

    total = 0.0
    reports = session.get_reports(store, generation, iteration, devices)
    for d in devices:  # summed in the devices' order, as before
        rep = reports.get(d)
        if rep is not None:
            total += float(rep.loss)
    return total


def held_lr(held: dict[Any, dict[str, Any]], steps_now: int, spec: Any, config: dict[str, Any]) -> list[float]:
    """The LR per parameter group after ``steps_now`` optimizer steps, from the state a
    rank held when it went idle (``held``: :func:`~.state.extract_units`)."""
    import torch

    from resihp_adapters.deepspeed.state import GLOBAL

    g = held.get(GLOBAL)
    if g is None:
        raise RuntimeError("get_lr: this rank holds no optimizer state (it never ran an engine)")
    groups = [dict(x) for x in g["groups"]]
    dummies = [torch.nn.Parameter(torch.zeros(1)) for _ in groups]
    opt = torch.optim.SGD([{**grp, "params": [p]} for grp, p in zip(groups, dummies)], lr=float(groups[0]["lr"]))
    sched = _scheduler(opt, spec, config)
    if sched is None:
        return [float(x["lr"]) for x in opt.param_groups]
    saved = g.get("lr_scheduler")
    if saved:
        state = sched.state_dict()
        state.update(saved)
        sched.load_state_dict(state)
    for x, grp in zip(opt.param_groups, groups):  # the held LR, as the scheduler left it
        x["lr"] = grp["lr"]
    for _ in range(max(0, int(steps_now) - int(g["counters"]["global_steps"]))):
        sched.step()
    return [float(x["lr"]) for x in opt.param_groups]


def _scheduler(opt: Any, spec: Any, config: dict[str, Any]) -> Any:
    """The scheduler the engine would build: the user's factory, else the JSON's
    ``scheduler`` (DeepSpeed's ``lr_schedules`` class by name), else None."""
    if spec.lr_scheduler is not None:
        return spec.lr_scheduler(opt)
    sc = config.get("scheduler")
    if not sc:
        return None
    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, str(sc["type"]), None)
    if cls is None:
        raise RuntimeError(f"get_lr: scheduler {sc['type']!r} is not one of DeepSpeed's lr_schedules")
    return cls(opt, **(sc.get("params") or {}))
