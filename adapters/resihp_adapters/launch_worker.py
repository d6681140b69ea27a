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
    from resihp_core.runtime.worker import end_on_job_error, end_script

    try:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):  # the script gave up: its own error, as it said
                raise ScriptExit(f"the script called sys.exit({e.code!r})") from e
        if not initialized():
            never_initialized(script, device)
    except Exception as e:  # noqa: BLE001 - the job's own error ends the job, a device's the process
        end_on_job_error(e)
    end_script()


def initialized() -> bool:
    from resihp_core.runtime import worker

    return bool(os.environ.get("RESIHP_INITIALIZED")) or worker._current is not None


class ScriptExit(RuntimeError):
    """The training script exited with a non-zero status of its own."""


class NeverInitialized(RuntimeError):
    """The training script ended without handing its training to ResiHP; ``where``
    names the script (the user's file, for the console's file:line)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def never_initialized(script: str, device: int) -> None:
    """The script returned without calling ``initialize()``: the job's error (one clear
    line on the console, not the exits of workers read as failed devices)."""
    raise NeverInitialized("the script ended without calling initialize(): under 'resihp launch' it must hand its "
                           "training to ResiHP (resihp_adapters.torch_native.initialize(model, optimizer=..., "
                           "dataset=...), or resihp_adapters.deepspeed.initialize)", where=os.path.abspath(script))


if __name__ == "__main__":
    main()
