"""``resihp launch`` for an accelerate config that uses FSDP2 (``distributed_type: FSDP``,
``fsdp_config: {fsdp_version: 2}``): the user's script on the torch_native adapter.

Where ResiHP's settings live. accelerate rejects unknown top-level keys in its config
file, turns unknown ``fsdp_config`` keys into launcher attributes no worker sees, and an
FSDP config names no other file (DeepSpeed's names its JSON, which keeps ResiHP's
``resihp`` section). So an FSDP job's settings are a ResiHP configuration file of its
own, in the ``resihp run`` schema (README, "Configuration"): ``resihp.toml`` beside the
accelerate YAML, or ``--resihp_config PATH``. accelerate decides the layout, the file
the rest:

* from accelerate: the number of workers (``num_processes``), hence ``parallel.dp =
  num_processes / parallel.pp`` and ``runtime.devices_per_node = num_processes /
  runtime.nodes``; the file may state them, and then they must agree;
* from the file: ``[parallel] pp`` and ``tp`` (TP > 1 with one replica: ``num_processes
  = tp x pp``), ``[model]``, ``[training]``
  (iterations, micro-batches, token budget, lr, dtype, checkpoints), ``[data]`` (the
  job's data source), ``[adapter] shard`` (HSDP shard degree), ``[detector]``,
  ``[runtime] nodes`` (agents emulating nodes on this machine; default 1).

The same file drives the script under plain ``accelerate launch`` (no resilience):
:func:`~resihp_adapters.torch_native.api.initialize` reads it from ``$RESIHP_CONFIG`` or
its ``config`` argument with :func:`settings`. Other ``fsdp_config`` fields (wrap policy,
prefetch, offload) are not used: the adapter wraps every transformer block and the stage.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["settings", "settings_path", "accelerate_env", "run"]

#: Detector defaults of a launch (a worker's first stage build can hold the GIL for
#: seconds on a loaded machine); the file's ``[detector]`` overrides them.
DETECTOR_DEFAULTS = {"heartbeat_miss_limit": 50, "hang_min_timeout_s": 30.0}


def _read(path: Path) -> dict[str, Any]:
    from resihp_core.config import ConfigError

    try:
        if path.suffix == ".toml":
            import tomllib

            return tomllib.loads(path.read_text())
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text()) or {}
            if not isinstance(data, dict):
                raise ConfigError("must be a mapping of sections", path=str(path))
            return data
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"cannot read the ResiHP configuration: {e}", path=str(path)) from None
    raise ConfigError("the ResiHP configuration must be a .toml, .yaml or .yml file", path=str(path))


def settings(path: str | os.PathLike, *, processes: int) -> Any:
    """The job's :class:`~resihp_core.config.Config`: the file at ``path`` with the
    layout of ``processes`` workers filled in (see the module docstring). Errors are
    :class:`~resihp_core.config.ConfigError` naming the field."""
    from resihp_core.config import Config, ConfigError

    path = Path(path)
    raw = _read(path)
    par = dict(raw.get("parallel") or {})
    rt = dict(raw.get("runtime") or {})
    tp, pp = par.get("tp", 1), par.get("pp", 2)
    if not isinstance(tp, int) or tp < 1 or (tp > 1 and processes != tp * pp):
        raise ConfigError(f"torch_native runs TP with one replica: accelerate's num_processes = {processes} "
                          f"must equal parallel.tp x parallel.pp (docs/torch_native.md, Tensor parallelism)",
                          path="parallel.tp", value=tp)
    if not isinstance(pp, int) or pp < 1 or processes % (pp * tp):
        raise ConfigError(f"accelerate's num_processes = {processes} must split into parallel.pp stages",
                          path="parallel.pp", value=pp)
    if par.setdefault("dp", processes // (pp * tp)) != processes // (pp * tp):
        raise ConfigError(f"accelerate's num_processes = {processes} with parallel.pp = {pp} gives "
                          f"dp = {processes // (pp * tp)}", path="parallel.dp", value=par["dp"])
    nodes = rt.setdefault("nodes", 1)
    if not isinstance(nodes, int) or nodes < 1 or processes % nodes:
        raise ConfigError(f"must divide accelerate's num_processes = {processes}", path="runtime.nodes", value=nodes)
    if rt.setdefault("devices_per_node", processes // nodes) != processes // nodes:
        raise ConfigError(f"accelerate's num_processes = {processes} over runtime.nodes = {nodes} gives "
                          f"{processes // nodes}", path="runtime.devices_per_node", value=rt["devices_per_node"])
    if rt.setdefault("adapter", "torch_native") != "torch_native":
        raise ConfigError("an FSDP accelerate config runs the torch_native adapter", path="runtime.adapter",
                          value=rt["adapter"])
    raw = {**raw, "parallel": par, "runtime": rt,
           "detector": {**DETECTOR_DEFAULTS, **(raw.get("detector") or {})}}
    return Config.from_dict(raw, source=str(path))


def settings_path(config_file: str, explicit: str | None) -> Path:
    """``--resihp_config``, else ``resihp.toml`` beside the accelerate config."""
    path = Path(explicit) if explicit else Path(config_file).resolve().parent / "resihp.toml"
    if not path.is_file():
        how = "" if explicit else (" (put ResiHP's settings in resihp.toml beside the accelerate config, "
                                   "or name them with --resihp_config)")
        raise ValueError(f"{path}: no such ResiHP configuration file{how}")
    return path.resolve()


def accelerate_env(config_file: str, script: str, script_args: list[str]) -> tuple[Any, dict[str, str]]:
    """accelerate's parsed launch arguments and the environment it gives FSDP workers
    (``prepare_multi_gpu_env``: ``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``, ...)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    a = launch_command_parser().parse_args(["--config_file", config_file, script, *script_args])
    a, _, _ = _validate_launch_command(a)
    if not a.use_fsdp:
        raise ValueError(f"{config_file}: distributed_type must be FSDP")
    if int(a.num_machines or 1) > 1:
        raise ValueError(f"{config_file}: num_machines = {a.num_machines}; 'resihp launch' starts every node's agent "
                         "on this machine (emulated nodes: [runtime] nodes in the ResiHP configuration). For "
                         "several hosts use 'resihp run --agents external' (docs/multihost.md)")
    env = prepare_multi_gpu_env(a)
    return a, dict(env)


def run(args: argparse.Namespace) -> int:
    """``resihp launch`` of an FSDP2 accelerate config; 0 when every iteration committed."""
    from resihp_core.cli import CliError
    from resihp_core.config import ConfigError
    from resihp_core.faults import FaultError, load_scenario
    from resihp_core.cli.run import run_controlled, work_folder
    from resihp_core.runtime.controller.jobs import assemble
    from resihp_core.runtime.controller.runconfig import RunHooks

    from resihp_core.runtime.controller.console import RunLog, console_observer, finish

    script = os.path.abspath(args.training_script)
    script_args = [a for a in args.training_script_args if a != "--"] if args.training_script_args else []
    try:
        a, env = accelerate_env(args.config_file, script, script_args)
        path = settings_path(args.config_file, getattr(args, "resihp_config", None))
        cfg = settings(path, processes=int(a.num_processes))
        n = cfg.runtime.nodes * cfg.runtime.devices_per_node
        faults = (load_scenario(args.faults, devices=range(n), iterations=cfg.training.iterations)
                  if getattr(args, "faults", None) else [])
        work = work_folder(args, "launch")
        job = assemble(cfg, faults, work)
    except (ValueError, OSError, ConfigError, FaultError) as e:
        raise CliError(str(e)) from e
    env.update(RESIHP_LAUNCH_SCRIPT=script, RESIHP_LAUNCH_ARGS=json.dumps(script_args),
               WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(cfg.runtime.devices_per_node),
               MASTER_ADDR=str(a.main_process_ip or "127.0.0.1"), MASTER_PORT=str(a.main_process_port or 29500),
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    os.environ.update(env)  # agents start here and pass their environment on to workers
    p = job.plan
    tps = sorted({len(g) for rep in p.tp_groups for g in rep})
    how = f"TP{tps[0]} x PP{p.pp} x DP{p.dp}, DTensor TP" if tps != [1] else f"PP{p.pp} x DP{p.dp}, FSDP2"
    log = RunLog(work)
    log.say(f"resihp launch: {n} workers of {script} on torch_native ({how}), "
            f"{cfg.training.iterations} iterations; settings {path}; run log {log.path}; worker logs in {work / 'job'}")
    # The controller's part is resihp run's: one controller per job, and --resume
    # re-attaches to live agents and workers (runtime.controller_grace_s > 0) or restores.
    out, start = run_controlled(cfg, job, work, args, worker_module="resihp_adapters.launch_worker",
                                timeout_s=args.timeout, hooks=RunHooks(observe=console_observer(log)))
    return finish(out, log, what="resihp launch", iterations=cfg.training.iterations, start=start)
