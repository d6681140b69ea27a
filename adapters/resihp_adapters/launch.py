"""``resihp launch --config_file accelerate.yaml train.py [args]``: an ``accelerate
launch`` that survives dead and slow devices, for whichever framework the accelerate
config names; ``resihp launch --resihp_config resihp.toml pretrain.py [args]`` (no
accelerate config): the ``torchrun`` of a Megatron-Core script
(:mod:`resihp_adapters.megatron_core.launch`).

The adapter follows from the accelerate config, read with accelerate's own loader:

==========================================  ==============  ===============================
accelerate config                           adapter         ResiHP's settings
==========================================  ==============  ===============================
``distributed_type: DEEPSPEED``             ``deepspeed``   ``resihp`` section of the
                                                            DeepSpeed JSON it names
``distributed_type: FSDP`` +                ``torch_native``  a ResiHP configuration file
``fsdp_config: {fsdp_version: 2}``                          (``resihp.toml`` beside the
                                                            YAML, or ``--resihp_config``)
==========================================  ==============  ===============================

What the two share lives here: the command line, choosing the framework, and the worker
entry (:mod:`resihp_adapters.launch_worker`). What differs (how accelerate's worker
environment is computed, where the settings are read, how the job is assembled) lives
with each adapter: :mod:`resihp_adapters.deepspeed.launch`,
:mod:`resihp_adapters.torch_native.launch`. Either way the job runs as any ResiHP job:
a controller here, one agent per node, and the user's script in every worker with the
environment ``accelerate launch`` would give it; unlike torchrun's elastic agent, an
agent does not stop a dead worker's siblings.

This module imports neither torch nor accelerate until a command runs.
"""

from __future__ import annotations

import argparse

from resihp_core.hookspecs import hookimpl

__all__ = ["configure", "run", "framework_of"]

#: framework name -> the module whose ``run(args)`` launches it
FRAMEWORKS = {"deepspeed": "resihp_adapters.deepspeed.launch", "torch_native": "resihp_adapters.torch_native.launch",
              "megatron_core": "resihp_adapters.megatron_core.launch"}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config_file", default=None,
                   help="accelerate config (YAML): DEEPSPEED naming a deepspeed_config_file, or FSDP with "
                        "fsdp_config.fsdp_version 2; none for a Megatron-Core script (--resihp_config names "
                        "its configuration)")
    p.add_argument("--resihp_config", default=None,
                   help="FSDP and Megatron-Core: the ResiHP configuration (TOML/YAML, the 'resihp run' schema); "
                        "FSDP default: resihp.toml beside the accelerate config")
    p.add_argument("--faults", default=None,
                   help="FSDP and Megatron-Core: inject faults from this JSON scenario (as 'resihp run --faults'); "
                        "DeepSpeed jobs list them in the JSON's resihp.faults")
    p.add_argument("--workdir", help="folder for logs and checkpoints (default: a fresh temporary folder)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    p.add_argument("--resume", action="store_true",
                   help="FSDP only: continue the job in --workdir: re-attach to its live workers after a controller "
                        "restart (runtime.controller_grace_s > 0), else restore its newest complete checkpoint")
    p.add_argument("training_script", help="the training script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")


def framework_of(config_file: str) -> str:
    """The adapter an accelerate config calls for (see the module docstring); ValueError
    naming the field otherwise."""
    try:
        from accelerate.commands.config.config_args import load_config_from_file
    except ImportError as e:
        raise ValueError(f"'resihp launch' reads accelerate configs: pip install 'resihp[accelerate]' ({e})") from None
    cfg = load_config_from_file(config_file)
    kind = str(getattr(cfg.distributed_type, "value", cfg.distributed_type))
    if kind == "DEEPSPEED":
        return "deepspeed"
    if kind == "FSDP":
        version = (cfg.fsdp_config or {}).get("fsdp_version", 1)
        if str(version) != "2":
            raise ValueError(f"{config_file}: fsdp_config.fsdp_version is {version!r}; 'resihp launch' runs FSDP2 "
                             "(fully_shard) on the torch_native adapter: set fsdp_version: 2")
        return "torch_native"
    raise ValueError(f"{config_file}: distributed_type is {kind}; 'resihp launch' takes DEEPSPEED (deepspeed "
                     "adapter) or FSDP with fsdp_version 2 (torch_native adapter)")


def run(args: argparse.Namespace) -> int:
    """``resihp launch``: the framework's launch; 0 when every iteration committed."""
    import importlib

    from resihp_core.cli import CliError

    if args.config_file is None:
        if not getattr(args, "resihp_config", None):
            raise CliError("resihp launch: give --config_file (accelerate: DeepSpeed or FSDP2) or, for a "
                           "Megatron-Core script, --resihp_config naming its ResiHP configuration")
        if getattr(args, "resume", False):
            raise CliError("--resume is for FSDP configs for now: run the Megatron-Core job again, or use "
                           "'resihp run' with runtime.controller_grace_s")
        return int(importlib.import_module(FRAMEWORKS["megatron_core"]).run(args))
    try:
        kind = framework_of(args.config_file)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from e
    if kind == "deepspeed":
        if getattr(args, "resume", False):
            raise CliError("--resume is for FSDP configs for now: a DeepSpeed launch has no controller failover "
                           "(run it again from the start, or use 'resihp run' with runtime.controller_grace_s)")
        for opt in ("resihp_config", "faults"):
            if getattr(args, opt, None):
                raise CliError(f"--{opt} is for FSDP configs: a DeepSpeed job reads ResiHP's settings (and faults) "
                               "from the 'resihp' section of its DeepSpeed JSON (docs/deepspeed.md)")
    return int(importlib.import_module(FRAMEWORKS[kind]).run(args))


@hookimpl(trylast=True)
def resihp_register_commands(registry) -> None:  # noqa: ANN001 - CommandRegistry
    """``resihp launch --config_file accelerate.yaml train.py [args]``."""
    registry.register("launch", "accelerate launch / torchrun, resilient: run a DeepSpeed, FSDP2 or Megatron-Core "
                      "script under ResiHP",
                      configure, run)
