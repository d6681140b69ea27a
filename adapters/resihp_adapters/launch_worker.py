"""The worker module ``resihp launch`` starts: the user's training script, given the
environment ``accelerate launch`` would have given it.

The node agent starts it (through the die-with-parent trampoline) with the ``RESIHP_*``
worker variables and accelerate's own variables (``ACCELERATE_USE_DEEPSPEED``,
``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``, ...); this adds the per-process ones torchrun
would (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``) from the device id, then runs the script
as ``__main__`` with its arguments. The script's ``initialize`` (DeepSpeed or
torch_native) sees ``RESIHP_STORE`` and trains under the worker runtime.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def main() -> None:
    script = os.environ.get("RESIHP_LAUNCH_SCRIPT")
    if not script:
        raise SystemExit(f"{__name__}: RESIHP_LAUNCH_SCRIPT is not set (it is started by 'resihp launch')")
    args = json.loads(os.environ.get("RESIHP_LAUNCH_ARGS", "[]"))
    device = int(os.environ["RESIHP_DEVICE"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.environ.update(RANK=str(device), LOCAL_RANK=str(device % per_node), GROUP_RANK=str(device // per_node))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    if not os.environ.get("RESIHP_INITIALIZED") and "resihp_core.runtime.worker" not in sys.modules:
        never_initialized(script, device)


#: The marker a worker leaves beside its job file when the script ended without calling
#: ``initialize()``; ``resihp launch`` turns it into one clear error.
MARKER = "never-initialized-{device}"


def never_initialized(script: str, device: int) -> None:
    """The script returned without handing its training to ResiHP: say so once (the
    launcher reads the marker) instead of leaving the controller to see exited workers."""
    job = os.environ.get("RESIHP_JOB")
    if job:
        with open(os.path.join(os.path.dirname(job), MARKER.format(device=device)), "w") as f:
            f.write(script)
    print(f"resihp launch: {script} ended without calling initialize() (resihp_adapters.torch_native."
          "initialize or resihp_adapters.deepspeed.initialize); nothing was trained under ResiHP",
          file=sys.stderr, flush=True)
    raise SystemExit(3)


#: The marker a worker leaves when the script's ResiHP call refused the job up front
#: (e.g. torch_native's loop mode on a pipelined job): its text is the reason.
REFUSED = "refused-{device}"


def refuse(reason: str) -> None:
    """Leave ``reason`` for ``resihp launch`` (one clear error, instead of the fail-stops
    the workers' exits would read as); the caller then raises. Nothing outside a launch."""
    job, device = os.environ.get("RESIHP_JOB"), os.environ.get("RESIHP_DEVICE")
    if job and device:
        with open(os.path.join(os.path.dirname(job), REFUSED.format(device=device)), "w") as f:
            f.write(reason)


def check_initialized(workdir: str | os.PathLike) -> None:
    """Raise :class:`NeverInitialized` if a worker of the job under ``workdir`` left the
    marker, or refused the job (:func:`refuse`)."""
    from pathlib import Path

    refused = sorted(Path(workdir).rglob(REFUSED.format(device="*")))
    if refused:
        raise NeverInitialized(f"the script refused the job: {refused[0].read_text()}")
    hits = sorted(Path(workdir).rglob(MARKER.format(device="*")))
    if hits:
        raise NeverInitialized(f"{hits[0].read_text()} never called initialize(): under 'resihp launch' the script "
                               "must hand its training to ResiHP (resihp_adapters.torch_native.initialize(model, "
                               "optimizer=..., dataset=...), or resihp_adapters.deepspeed.initialize); "
                               f"{len(hits)} worker(s) ended without it")


class NeverInitialized(RuntimeError):
    """The launched script never called ``initialize()``."""


if __name__ == "__main__":
    main()
