"""``resihp launch --resihp_config resihp.toml pretrain.py [args]``: a user's
``pretrain_gpt``-shaped script (it calls :func:`~.api.initialize`) on the megatron_core
adapter, the launch ``torchrun`` would be for the same script.

Megatron-Core jobs start under ``torchrun``, not accelerate, so there is no accelerate
config: the ResiHP configuration file (the ``resihp run`` schema, ``[runtime] adapter =
"megatron_core"``) gives the layout (``[parallel]``), the workers (``[runtime] nodes x
devices_per_node``, agents emulating nodes on this machine), the length and
checkpoints (``[training]``) and the detector; the script gives the job. Each worker
gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), runs the
script as ``__main__``, and its ``initialize`` hands the job to the worker runtime.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

__all__ = ["run"]

#: Detector defaults of a launch (building a stage imports Megatron-Core and can hold
#: the GIL for seconds on a loaded machine); the file's ``[detector]`` overrides them.
DETECTOR_DEFAULTS = {"heartbeat_miss_limit": 50, "hang_min_timeout_s": 30.0}


def run(args: argparse.Namespace) -> int:
    """``resihp launch`` of a megatron_core configuration; 0 when every iteration committed."""
    from resihp_core.cli import CliError
    from resihp_core.config import Config, ConfigError
    from resihp_core.faults import FaultError, load_scenario
    from resihp_core.cli.run import run_controlled, work_folder
    from resihp_core.runtime.controller.console import RunLog, console_observer, finish
    from resihp_core.runtime.controller.jobs import assemble
    from resihp_core.runtime.controller.runconfig import RunHooks

    from resihp_adapters.torch_native.launch import _read

    script = os.path.abspath(args.training_script)
    script_args = [a for a in args.training_script_args if a != "--"] if args.training_script_args else []
    path = Path(args.resihp_config).resolve()
    try:
        raw = _read(path)
        raw["detector"] = {**DETECTOR_DEFAULTS, **(raw.get("detector") or {})}
        cfg = Config.from_dict(raw, source=str(path))
        if cfg.runtime.adapter != "megatron_core":
            raise ConfigError("'resihp launch' without an accelerate config runs megatron_core scripts",
                              path="runtime.adapter", value=cfg.runtime.adapter)
        n = cfg.runtime.nodes * cfg.runtime.devices_per_node
        faults = (load_scenario(args.faults, devices=range(n), iterations=cfg.training.iterations)
                  if getattr(args, "faults", None) else [])
        work = work_folder(args, "launch")
        job = assemble(cfg, faults, work)
    except (ValueError, OSError, ConfigError, FaultError) as e:
        raise CliError(str(e)) from e
    os.environ.update(RESIHP_LAUNCH_SCRIPT=script, RESIHP_LAUNCH_ARGS=json.dumps(script_args), WORLD_SIZE=str(n),
                      LOCAL_WORLD_SIZE=str(cfg.runtime.devices_per_node), MASTER_ADDR="127.0.0.1",
                      OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = job.plan
    log = RunLog(work)
    log.say(f"resihp launch: {n} workers of {script} on megatron_core (TP{cfg.parallel.tp} x PP{p.pp} x DP{p.dp}), "
            f"{cfg.training.iterations} iterations; settings {path}; run log {log.path}; worker logs in {work / 'job'}")
    out, start = run_controlled(cfg, job, work, args, worker_module="resihp_adapters.launch_worker",
                                timeout_s=args.timeout, hooks=RunHooks(observe=console_observer(log)))
    return finish(out, log, what="resihp launch", iterations=cfg.training.iterations, start=start)

