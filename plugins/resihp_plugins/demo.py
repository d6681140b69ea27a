"""``resihp demo``: one fixed configuration (:data:`DEMO_CONFIG`) of ``resihp run`` with two
injected faults, on this machine.

Eight worker processes of the reference backend train a small LLaMA-style model on the
variable-length corpus. Two node agents (four devices each) watch them and feed the
controller; the Scheduler plans every reconfiguration; the supervisor deploys it live.
A compute fail-slow is injected on one device, then a fail-stop (SIGKILL) on another.
A live terminal view shows iteration, throughput, plan generation and per-device
health; the run ends with a summary table and a report folder (JSON events, loss
against a fault-free reference, iteration-time trace with detections and plan
changes, throughput per phase, as PNG plots). The job itself is assembled and run by
:mod:`resihp_core.cli.run`.
"""

from __future__ import annotations

import argparse

from resihp_core.hookspecs import hookimpl

__all__ = ["DEMO_CONFIG", "run_demo", "resihp_register_commands"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=36, help="training iterations (default 36)")
    p.add_argument("--slow-at", type=int, default=8, help="iteration of the compute fail-slow")
    p.add_argument("--kill-at", type=int, default=22, help="iteration of the SIGKILL")
    p.add_argument("--severity", default="strong", choices=["weak", "medium", "strong"])
    p.add_argument("--report", default="reports", help="parent folder of the report")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    p.add_argument("--adapter", choices=["megatron_ref", "deepspeed"], default="megatron_ref",
                   help="megatron_ref: the reference backend, TP2 x PP2 x DP2 (default); deepspeed: "
                        "examples/deepspeed_pipeline under 'resihp launch', PP2 x DP2, with a kill")


DEMO_CONFIG = {
    "parallel": {"tp": 2, "pp": 2, "dp": 2},
    "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "ffn_hidden": 128},
    "training": {"microbatches": 4, "token_budget": 256, "iterations": 36, "lr": 3e-3},
    "runtime": {"nodes": 2, "devices_per_node": 4},
    "detector": {"heartbeat_interval_s": 0.1, "heartbeat_miss_limit": 8, "hang_min_timeout_s": 20.0,
                 "warmup_iterations": 3, "min_changepoint_gap": 3},
}


def run_demo(args: argparse.Namespace) -> int:
    if getattr(args, "adapter", "megatron_ref") == "deepspeed":
        from resihp_adapters.deepspeed.launch import run_demo as deepspeed_demo

        return deepspeed_demo(args)
    from resihp_core.config import Config
    from resihp_core.faults import fail_at
    from resihp_core.plan import ParallelPlan
    from resihp_core.cli.run import run_job

    data = {**DEMO_CONFIG, "training": {**DEMO_CONFIG["training"], "iterations": args.iterations}}
    cfg = Config.from_dict(data, source="the demo")
    p = cfg.parallel
    layout = ParallelPlan.uniform(tp=p.tp, pp=p.pp, dp=p.dp, num_layers=cfg.model.layers,
                                  num_microbatches=cfg.training.microbatches)
    faults = [fail_at(layout.group(1, 1)[0], args.slow_at, "slow", severity=args.severity),
              fail_at(layout.group(0, 0)[1], args.kill_at, "kill")]
    return run_job(cfg, faults, args, "resihp demo: TP2 x PP2 x DP2 on CPU", "demo")


@hookimpl
def resihp_register_commands(registry) -> None:
    """``resihp demo``."""
    registry.register("demo", "run the end-to-end demo (8 CPU workers, fail-slow then fail-stop)",
                      configure, run_demo)
