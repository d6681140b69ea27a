"""Cluster-scale evaluation: ResiHP vs the comparison systems on failure traces (SPEC §7).

For each job (LLaMA-2 7B on 16 devices, 13B on 32, 70B on 256; 30B on 64 in the full
run) and each scenario (fail-stop at MTBF 2 h / 1 h / 30 min with 1 h repairs,
fail-slow at weak / medium / strong severity, mixed), simulates every registered
policy on the same seeded traces with the cluster simulator (``resihp_core.sim``) and
prints the retained fraction of fault-free throughput with its 95 % confidence
interval over seeds, and ResiHP's throughput over each policy's. Also:

- the idle-GPU-time amplification of one slowed device through TP / PP / DP, without
  mitigation and with ResiHP's plan;
- a 256-device, 12-hour mixed trace under ResiHP, timed (target: < 60 s);
- a scale sweep (16 -> 1,024 devices with --quick, -> 16,384 in the full run, or
  --scale-max) printing simulator wall time per simulated hour of training (target at
  16,384: < 10 minutes for the point).

    python benchmarks/cluster.py [--quick] [--json PATH] [--plots DIR] [--seeds N] [--hours H]

Exits 1 if it could not measure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from resihp_core.sim.calibration import E2E_LAYOUTS, predicted_ratio  # noqa: E402
from resihp_core.sim.cluster import STANDARD_JOBS, JobSpec  # noqa: E402
from resihp_core.sim.engine import run  # noqa: E402
from resihp_core.sim.report import amplification, plot, policy, policy_names, summarise, sweep  # noqa: E402
from resihp_core.sim.trace import Scenario, generate  # noqa: E402

SCENARIOS = ["stop-2h", "stop-1h", "stop-30m", "slow-weak", "slow-medium", "slow-strong", "mixed"]
SCALE_JOBS = {
    16: JobSpec("llama2-7b", 4, 2, 2, 16),
    64: JobSpec("llama-30b", 4, 8, 2, 32),
    256: JobSpec("llama2-70b", 4, 16, 4, 64),
    1024: JobSpec("llama2-70b", 8, 16, 8, 64),
    4096: JobSpec("llama2-70b", 8, 16, 32, 64),
    16384: JobSpec("llama2-70b", 8, 16, 128, 64),
}
#: The scale sweep's trace: a fail-stop and a fail-slow every 30 min on average.
SCALE_SCENARIO = Scenario("scale-mixed", mtbf_s=1800.0, slow_every_s=1800.0, severity="mixed")
TARGET_256_S = 60.0
TARGET_16K_S = 600.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--plots", type=Path, help="write throughput-over-time PNGs here")
    ap.add_argument("--seeds", type=int, help="traces per scenario (quick 3, full 5)")
    ap.add_argument("--hours", type=float, help="job time per trace (quick 6, full 12)")
    ap.add_argument("--jobs", help="comma-separated job sizes (quick 16,32,256; full 16,32,64,256)")
    ap.add_argument("--scale-max", type=int, help="largest device count of the scale sweep")
    ap.add_argument("--scale-hours", type=float, default=1.0, help="simulated hours per sweep point")
    ap.add_argument("--calibrate", type=Path, metavar="E2E_JSON",
                    help="compare the simulated adaptation ratios with a measured benchmarks/e2e.py --json file")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def _calibration(e2e_json: Path | None) -> list[dict[str, Any]]:
    """Simulated ResiHP / no-mitigation ratios of e2e.py's one-core layouts, beside the
    measured steady-state ratios when an e2e JSON file is given (target: within 10 %)."""
    measured = json.loads(e2e_json.read_text()) if e2e_json else {}
    rows = []
    print("\nCalibration: medium compute fail-slow (2.22x), ResiHP / no mitigation, steady state")
    print(f"{'layout':<12} {'simulated':>9} {'measured':>9} {'diff':>7}")
    for name in E2E_LAYOUTS:
        sim = predicted_ratio(name)
        real = (measured.get(name) or {}).get("ratio_steady")
        row = {**sim, "measured": real}
        if real:
            row["relative_difference"] = sim["ratio"] / real - 1
        rows.append(row)
        diff = f"{100 * row['relative_difference']:+.1f}%" if real else "-"
        print(f"{name:<12} {sim['ratio']:>9.3f} {real if real else '-':>9} {diff:>7}")
    return rows


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    seeds = a.seeds or (3 if a.quick else 5)
    hours = a.hours or (6.0 if a.quick else 12.0)
    jobs = [int(x) for x in a.jobs.split(",")] if a.jobs else ([16, 32, 256] if a.quick else [16, 32, 64, 256])
    scale_max = a.scale_max or (1024 if a.quick else 16384)
    pols = policy_names()
    out: dict[str, Any] = {"config": {"quick": a.quick, "seeds": seeds, "hours": hours, "jobs": jobs,
                                      "scenarios": SCENARIOS, "policies": pols,
                                      "load_average_start": os.getloadavg()},
                           "tables": {}, "amplification": {}, "scale": [], "metrics": {}}
    t0 = time.perf_counter()
    try:
        for n in jobs:
            job = STANDARD_JOBS[n]
            res = sweep(job, SCENARIOS, pols, seeds=seeds, hours=hours,
                        progress=not a.no_progress and sys.stderr.isatty())
            summ = summarise(res)
            out["tables"][str(n)] = {"job": job.to_dict(), "summary": summ,
                                     "costs": res["costs"].to_dict()}
            print(f"\n{n} devices, {job.model} (tp={job.tp} pp={job.pp} dp={job.dp} "
                  f"m={job.num_microbatches}): retained fraction of fault-free throughput, "
                  f"mean ± 95% CI over {seeds} seeds of {hours:g} h")
            print(f"{'scenario':<12}" + "".join(f"{p:>14}" for p in pols))
            for scen in SCENARIOS:
                row = summ[scen]
                print(f"{scen:<12}" + "".join(
                    f"{row[p]['retained']:>8.3f}±{row[p]['retained_ci95']:<5.3f}" for p in pols))
            print("ResiHP throughput / policy throughput (mean over seeds)")
            print(f"{'scenario':<12}" + "".join(f"{p:>14}" for p in pols if p != "resihp"))
            for scen in SCENARIOS:
                row = summ[scen]
                print(f"{scen:<12}" + "".join(
                    f"{row[p].get('resihp_over', float('nan')):>14.3f}" for p in pols if p != "resihp"))
                for p in pols:
                    out["metrics"][f"retained/{n}/{scen}/{p}"] = round(row[p]["retained"], 4)
            if a.plots:
                a.plots.mkdir(parents=True, exist_ok=True)
                for scen in ("mixed", "stop-30m", "slow-strong"):
                    runs = [res["results"][scen][p][0] for p in pols]
                    plot(runs, res["traces"][scen][0], a.plots / f"cluster-{n}-{scen}.png")
            amp = amplification(job)
            out["amplification"][str(n)] = amp
            u, m = amp["unmitigated"], amp["mitigated"]
            print(f"idle-GPU amplification of one medium compute-slow device: {amp['amplification']:.1f}x "
                  f"unmitigated (extra idle GPU-s/iteration: TP {u['tp']:.2f}, PP {u['pp']:.2f}, "
                  f"DP {u['dp']:.2f}), {amp['amplification_mitigated']:.1f}x with ResiHP "
                  f"(TP {m['tp']:.2f}, PP {m['pp']:.2f}, DP {m['dp']:.2f}, out of plan {m['out_of_plan']:.2f})",
                  flush=True)
        # 256 devices, 12 hours, mixed: the speed target.
        job = STANDARD_JOBS[256]
        st = job.state()
        tr = generate("mixed", job, seed=0, hours=12.0, state=st)
        w = time.perf_counter()
        r = run(tr, policy("resihp"), state0=st)
        t256 = time.perf_counter() - w
        out["speed_256_12h"] = {"wall_s": t256, "events": len(tr.events), "retained": r.retained,
                                "target_s": TARGET_256_S, "ok": t256 < TARGET_256_S}
        print(f"\n256 devices, 12 h mixed trace ({len(tr.events)} events), ResiHP: {t256:.1f} s "
              f"(target < {TARGET_256_S:.0f} s: {'yes' if t256 < TARGET_256_S else 'NO'})", flush=True)
        print(f"\nScale sweep ({SCALE_SCENARIO.name}: fail-stop and fail-slow every 30 min on average; "
              f"ResiHP policy; {a.scale_hours:g} simulated h per point)")
        print(f"{'devices':>8} {'events':>7} {'wall s':>8} {'wall s / sim h':>15} {'retained':>9}")
        for n, job in SCALE_JOBS.items():
            if n > scale_max:
                continue
            w = time.perf_counter()
            st = job.state()
            tr = generate(SCALE_SCENARIO, job, seed=0, hours=a.scale_hours, state=st)
            r = run(tr, policy("resihp"), state0=st)
            wall = time.perf_counter() - w
            row = {"devices": n, "job": job.to_dict(), "events": len(tr.events), "wall_s": wall,
                   "wall_s_per_sim_hour": wall / a.scale_hours, "retained": r.retained}
            out["scale"].append(row)
            print(f"{n:>8} {len(tr.events):>7} {wall:>8.1f} {wall / a.scale_hours:>15.1f} {r.retained:>9.3f}",
                  flush=True)
            if n == 16384:
                out["speed_16k_ok"] = wall < TARGET_16K_S
        out["calibration"] = _calibration(a.calibrate)
    except Exception as e:  # pragma: no cover - report and fail
        import traceback

        traceback.print_exc()
        print(f"could not measure: {e!r}", file=sys.stderr)
        return 1
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["config"]["load_average_end"] = os.getloadavg()
    print(f"\nload average: {os.getloadavg()[0]:.1f}; {out['seconds']} s in all")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
