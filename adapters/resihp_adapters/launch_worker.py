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


if __name__ == "__main__":
    main()
