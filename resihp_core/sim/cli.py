"""``resihp simulate SCENARIO``: run the cluster simulator from the command line.

SCENARIO is a scenario name (:data:`~resihp_core.sim.trace.SCENARIOS`) drawn for
``--seeds`` seeds, or a trace file (``resihp-trace v1`` JSON, e.g. written by
``--traces DIR``), replayed exactly. Prints retained throughput per policy with 95 %
confidence intervals and the ratio of ResiHP's throughput to each policy's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["configure", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", metavar="SCENARIO",
                   help="scenario name (stop-2h, stop-1h, stop-30m, slow-weak, slow-medium, slow-strong, "
                        "mixed, none) or a trace file to replay")
    p.add_argument("--devices", type=int, choices=[16, 32, 64, 256, 16384, 131072],
                   help="a docs/design.md §7 job (16: LLaMA-2 7B, 32: 13B, 64: 30B, 256: 70B; 16384: 70B "
                        "TP8 PP16 DP128, 131072: 70B TP8 PP16 DP1024, 64 micro-batches); default 16")
    p.add_argument("--model", help="model name (overrides --devices' model)")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--microbatches", type=int, help="micro-batches per replica")
    p.add_argument("--hours", type=float, default=12.0, help="job time to simulate (default 12)")
    p.add_argument("--seeds", type=int, default=3, help="traces per scenario (default 3)")
    p.add_argument("--policies", help="comma-separated policy names (default: all registered)")
    p.add_argument("--json", type=Path, help="write the summary and every run's event log here")
    p.add_argument("--plot", type=Path, help="PNG of throughput over time (first trace), failures marked")
    p.add_argument("--traces", type=Path, help="write the generated trace files to this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _job(args: argparse.Namespace) -> Any:
    from dataclasses import replace

    from resihp_core.sim.cluster import STANDARD_JOBS, JobSpec

    job = STANDARD_JOBS[args.devices or 16]
    changes = {k: v for k, v in (("model", args.model), ("tp", args.tp), ("pp", args.pp), ("dp", args.dp),
                                 ("num_microbatches", args.microbatches)) if v is not None}
    return replace(job, **changes) if changes else JobSpec(**job.to_dict())


def run(args: argparse.Namespace) -> int:
    from resihp_core.cli import CliError
    from resihp_core.plugins import UnknownNameError
    from resihp_core.plan import PlanError
    from resihp_core.sim.cluster import SimError
    from resihp_core.sim.report import plot, policy_names, summarise, sweep
    from resihp_core.sim.trace import SCENARIOS, Trace

    if args.seeds < 1:
        raise CliError(f"--seeds must be >= 1, got {args.seeds}")
    if not args.hours > 0:
        raise CliError(f"--hours must be > 0, got {args.hours}")
    names = policy_names()
    pols = names if not args.policies else [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in pols if p not in names]
    if bad:
        raise CliError(f"--policies: unknown policy {', '.join(bad)} (registered: {', '.join(names)})")
    try:
        if args.scenario in SCENARIOS:
            job = _job(args)
            scen: Any = args.scenario
        else:
            path = Path(args.scenario)
            if not path.exists():
                raise CliError(f"SCENARIO {args.scenario!r} is neither a scenario name "
                               f"({', '.join(SCENARIOS)}) nor a trace file")
            scen = Trace.load(path)
            job = scen.job
        out = sweep(job, [scen], pols, seeds=args.seeds, hours=args.hours, progress=not args.no_progress and sys.stderr.isatty(),
                    trace_dir=args.traces)
    except (SimError, PlanError, UnknownNameError) as e:
        raise CliError(str(e)) from e
    summary = summarise(out)
    scen_name = next(iter(out["results"]))
    print(f"{job.devices} devices, {job.model} (tp={job.tp} pp={job.pp} dp={job.dp} "
          f"m={job.num_microbatches}); {scen_name}; {len(out['traces'][scen_name])} trace(s) of "
          f"{out['traces'][scen_name][0].duration_s / 3600:g} h")
    print(f"{'policy':<18} {'samples/s':>18} {'retained':>16} {'resihp / policy':>18}")
    for pol in pols:
        d = summary[scen_name][pol]
        ratio = d.get("resihp_over")
        rtxt = "-" if ratio is None else f"{ratio:.3f}±{d['resihp_over_ci95']:.3f}"
        print(f"{pol:<18} {d['throughput']:>10.2f}±{d['throughput_ci95']:<7.2f} "
              f"{d['retained']:>9.3f}±{d['retained_ci95']:<6.3f} {rtxt:>18}")
    if args.plot:
        runs = [out["results"][scen_name][p][0] for p in pols]
        print(f"plot: {plot(runs, out['traces'][scen_name][0], args.plot)}")
    if args.json:
        data = {"job": job.to_dict(), "costs": out["costs"].to_dict(), "scenario": scen_name,
                "summary": summary,
                "runs": [r.to_dict() for p in pols for r in out["results"][scen_name][p]]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0
