"""``engine.load_checkpoint`` of DeepSpeed's own format under ``resihp launch``: all or
nothing, on every rank of the plan generation.

DeepSpeed's ``load_checkpoint`` writes into the engine as it reads: a layer file that
does not fit (another model), a truncated file or a missing stage file raises halfway,
with some layers (or the optimizer) already replaced. Here every rank first checks
what it can without touching the engine (the tag, its stage's file readable, of the
step the job stands at), the ranks agree, and only then DeepSpeed loads; if DeepSpeed
raises on any rank, every rank puts back the state it held before (parameters,
optimizer state, LR scheduler, counters: :func:`~.state.extract_units`) and the call
raises with each failing rank's reason.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["CheckpointNotLoaded", "load_all_or_nothing"]


class CheckpointNotLoaded(RuntimeError):
    """``load_checkpoint`` loaded nothing (every rank's engine is as before); the
    message names each failing rank's reason."""


def _tag(load_dir: str, tag: str | None) -> str | None:
    """DeepSpeed's tag choice: ``tag`` or the ``latest`` file's; None when neither
    (DeepSpeed then loads nothing and returns ``(None, None)``)."""
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def _check(engine: Any, load_dir: str, tag: str, step: int | None) -> None:
    """What can be checked before DeepSpeed touches the engine: this stage's file
    exists, reads, and is of ``step`` (None: any step)."""
    import torch

    path = engine._get_ckpt_name(load_dir, tag)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist")
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(ck, dict) or "global_steps" not in ck:
        raise ValueError(f"{path} is not a DeepSpeed model-states file (no global_steps)")
    if step is not None and int(ck["global_steps"]) != int(step):
        raise ValueError(f"{path} is of step {ck['global_steps']}, the job stands at iteration {step}; ResiHP "
                         "resumes a job only where its runtime stands")


def _failures(err: str | None) -> list[str]:
    """Every rank's error of this phase (``rank R: ...``), the same list on every rank."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return [f"rank 0: {err}"] if err else []
    errs: list[str | None] = [None] * tdist.get_world_size()
    tdist.all_gather_object(errs, err)
    return [f"rank {r}: {e}" for r, e in enumerate(errs) if e]


def load_all_or_nothing(engine: Any, load_dir: str, tag: str | None, step: int | None,
                        **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
    """DeepSpeed's ``engine.load_checkpoint(load_dir, tag, **kwargs)`` on every rank of
    the generation (a collective), loading everything or nothing (module docstring);
    ``step``: the step the checkpoint must be of (None: any, as plain DeepSpeed).
    Returns DeepSpeed's ``(load_path, client_state)``; ``(None, None)`` as DeepSpeed when
    ``load_dir`` has no ``latest`` and no tag is given."""
    from resihp_adapters.deepspeed.state import apply_units, extract_units

    err = None
    try:
        tag = _tag(load_dir, tag)
        if tag is not None:
            _check(engine, load_dir, tag, step)
    except Exception as e:  # noqa: BLE001 - reported by rank below
        err = f"{type(e).__name__}: {e}"
    failed = _failures(err)
    if failed:
        raise CheckpointNotLoaded(f"engine.load_checkpoint({load_dir!r}): {'; '.join(failed)}; nothing was loaded")
    if tag is None:
        return None, None
    before = extract_units(engine)
    result: tuple[Any, Any] = (None, None)
    try:
        result = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        if result[0] is None:
            raise RuntimeError(f"DeepSpeed loaded nothing from tag {tag!r}")
    except Exception as e:  # noqa: BLE001 - every rank puts its state back below
        err = f"{type(e).__name__}: {e}"
    failed = _failures(err)
    if failed:
        apply_units(engine, before)
        raise CheckpointNotLoaded(f"engine.load_checkpoint({load_dir!r}): {'; '.join(failed)}; nothing was "
                                  "loaded (every rank's parameters, optimizer state and LR scheduler are as before)")
    return result
