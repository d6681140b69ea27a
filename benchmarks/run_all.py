"""Run every benchmark several times and write the measured table (markdown + JSON).

Each benchmark script runs ``--reps`` times as its own process (``--quick`` passed
through), the repetitions interleaved (round 1 of every benchmark, then round 2, ...)
so a change of the machine's load hits all of them alike. The load average is read
before and after every run, and the machine (CPU model, cores, memory, kernel) is
recorded. Every figure is reported as the median over the repetitions with the range
(min-max) across them; ``e2e.py`` repeats its paired comparisons inside one process
(``--reps``), so its range is across its pairs. The README's measured table is this
script's markdown output.

    python benchmarks/run_all.py [--quick] [--reps N] [--only NAME ...] [--out DIR] [--compare OLD.json]

Writes ``DIR/measured.md`` and ``DIR/measured.json`` (default ``benchmarks/results``)
and prints the table; with ``--compare`` also ``DIR/rerun.md``: whether each median
lies inside the range of an earlier run. Exit status 1 if a benchmark could not measure in any repetition
(its figures are then missing from the table, and its error is in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchstats import loadavg, machine  # noqa: E402

Values = dict[str, list[float]]  # figure -> values (one per repetition, or per pair)


def _get(d: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _put(out: Values, key: str, v: Any) -> None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        out.setdefault(key, []).append(float(v))


def predictor(j: dict) -> Values:
    out: Values = {}
    for k in ("mape_total_pct", "mape_floor_pct", "mape_total_beyond_floor_pct", "mape_total_perdoc_pct",
              "mape_total_naive_pct", "mape_total_wall_pct"):
        _put(out, k, j.get(k))
    return out


def simulator(j: dict) -> Values:
    out: Values = {}
    for c in j.get("cases", []):
        _put(out, f"simulate_ms {c['devices']} devices {c['shape'].split()[-1]}", c.get("simulate_ms"))
    return out


def scheduler(j: dict) -> Values:
    out: Values = {}
    t = j.get("targets", {})
    if isinstance(t.get("scenarios"), int):
        _put(out, "scenarios never worse than any 1-D policy",
             t["scenarios"] - len(t.get("worse_cases", [])))
    for k in ("latency_256_ms", "latency_16k_s"):
        _put(out, k, t.get(k))
    for k, v in sorted(t.items()):  # optimality gaps, whichever reference the script has
        if k.startswith("max_gap") and isinstance(v, (int, float)):
            _put(out, f"{k} (%)", 100 * v)
    return out


def detector(j: dict) -> Values:
    out: Values = {}
    s = j.get("summary", {})
    fa = s.get("resihp_false_alarms_per_run") or {}
    if fa:
        _put(out, "ResiHP false alarms per run (worst workload)", max(fa.values()))
    fb = s.get("baseline_false_alarms_per_run") or {}
    if fb:
        _put(out, "baseline false alarms per run (worst workload)", max(fb.values()))
    _put(out, "accuracy_pct", s.get("resihp_accuracy_pct"))
    _put(out, "fail-slow latency max (iterations)", s.get("resihp_failslow_latency_max_iterations"))
    _put(out, "fail-stop latency max (iterations)", s.get("resihp_failstop_latency_max_iterations"))
    o = j.get("overhead", {})
    _put(out, "overhead_pct (A/B, real backend)", o.get("overhead_pct"))
    ci = o.get("overhead_ci95_pct")
    if ci:
        _put(out, "overhead_pct 95 % CI low", ci[0])
        _put(out, "overhead_pct 95 % CI high", ci[1])
    _put(out, "overhead direct cost_pct", o.get("direct_cost_pct"))
    return out


def reconfigure(j: dict) -> Values:
    out: Values = {}
    _put(out, "kill -> first iteration_s", j.get("kill_kill_to_first_iteration_s"))
    _put(out, "rebuild_s", j.get("kill_rebuild_s"))
    for k in ("iteration_mape_pct", "mape_floor_pct", "mape_beyond_floor_pct"):
        _put(out, k, j.get(k))
    rates = [m["bytes_moved"] / m["state_s"] / 1e6 for m in j.get("migration", []) if m.get("state_s")]
    if rates:
        _put(out, "layer migration MB/s (median of moves)", statistics.median(rates))
    return out


def e2e(j: dict) -> Values:
    """Per pair (the repetitions of e2e.py), flagged pairs left out; controls kept."""
    out: Values = {}
    for name, r in j.items():
        if not isinstance(r, dict) or "pairs" not in r:
            continue
        if name == "failstop":
            for i, v in enumerate(r.get("ratios", [])):
                if i not in r.get("flagged_pairs", []):
                    _put(out, "fail-stop recovered / best fresh static", v)
            out.setdefault("fail-stop flagged repetitions", []).append(float(len(r.get("flagged_pairs", []))))
            continue
        w = r.get("window", {})
        for i, v in enumerate(w.get("ratios", [])):
            if i not in w.get("flagged", []):
                _put(out, f"{name}: retained ratio, window", v)
        st = r.get("steady") or {}
        for i, v in enumerate(st.get("ratios", [])):
            if i not in st.get("flagged", []):
                _put(out, f"{name}: retained ratio, steady", v)
        for v in w.get("controls", []):
            _put(out, f"{name}: healthy-phase control", v)
        out.setdefault(f"{name}: flagged pairs", []).append(float(len(w.get("flagged", []))))
    return out


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    extract: Callable[[dict], Values]
    target: dict[str, str]  # figure prefix -> target text
    internal_reps: bool = False  # repeats itself (--reps): run once


BENCHES = [
    Bench("predictor", "predictor_accuracy.py", predictor,
          {"mape_total_pct": "<= 2 %", "mape_floor_pct": "< 1 % (to judge 2 %)"}),
    Bench("simulator", "simulator_speed.py", simulator,
          {"simulate_ms 256": "<= 10 ms", "simulate_ms 16384": "<= 500 ms"}),
    Bench("scheduler", "scheduler.py", scheduler,
          {"scenarios never": "all", "latency_256_ms": "<= 100 ms", "latency_16k_s": "<= 2 s",
           "max_gap_sim": "<= 5 %"}),
    Bench("detector", "detector.py", detector,
          {"ResiHP false": "<= 0.3", "baseline false": ">= 3", "accuracy": ">= 99 %",
           "fail-slow latency": "<= 3", "fail-stop latency": "<= 3", "overhead_pct (A/B": "<= 1 %"}),
    Bench("reconfigure", "reconfigure.py", reconfigure,
          {"kill -> first": "<= 2 s", "iteration_mape_pct": "<= 5 %"}),
    Bench("e2e", "e2e.py", e2e,
          {"one_core_pp: retained ratio": ">= 1.3x", "one_core_dp: retained ratio": ">= 1.3x",
           "oversubscribed: retained ratio": ">= 1.3x", "fail-stop recovered": ">= 0.9",
           "one_core_pp: healthy": "~1", "one_core_dp: healthy": "~1", "oversubscribed: healthy": "~1"},
          internal_reps=True),
]


def _target(b: Bench, figure: str) -> str:
    return next((t for k, t in b.target.items() if figure.startswith(k)), "")


def run_one(b: Bench, quick: bool, reps: int, timeout: float) -> dict[str, Any]:
    fd, path = tempfile.mkstemp(suffix=".json", prefix=f"resihp-{b.name}-")
    os.close(fd)
    cmd = [sys.executable, str(HERE / b.script), "--json", path] + (["--quick"] if quick else [])
    if b.internal_reps:
        cmd += ["--reps", str(reps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load0, t0 = loadavg(), time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, tail = p.returncode, (p.stdout[-3000:], p.stderr[-3000:])
    except subprocess.TimeoutExpired:
        rc, tail = -1, ("", f"timed out after {timeout} s")
    rec: dict[str, Any] = {"benchmark": b.name, "rc": rc, "seconds": round(time.time() - t0, 1),
                           "loadavg_before": load0, "loadavg_after": loadavg(),
                           "started": datetime.datetime.fromtimestamp(t0, datetime.timezone.utc).isoformat()}
    try:
        data = json.loads(Path(path).read_text())
        rec["values"] = b.extract(data)
    except (OSError, ValueError) as e:
        rec["values"] = {}
        rec["error"] = f"no JSON: {e}; stdout: {tail[0][-500:]} stderr: {tail[1][-1500:]}"
    finally:
        Path(path).unlink(missing_ok=True)
    if rc != 0:
        said = [ln for ln in tail[1].splitlines() if "could not measure" in ln]  # the scripts' own words
        why = " / ".join(ln[:300] for ln in said) if said else tail[1][-1500:]
        rec["error"] = (rec.get("error", "") + f" exit {rc}: {why}").strip()
    return rec


def _num(v: float) -> str:
    a = abs(v)
    return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.1 else f"{v:.3f}"


def table(records: list[dict[str, Any]], benches: list[Bench]) -> list[dict[str, Any]]:
    rows = []
    for b in benches:
        recs = [r for r in records if r["benchmark"] == b.name]
        vals: Values = {}
        for r in recs:
            for k, v in r["values"].items():
                vals.setdefault(k, []).extend(v)
        loads = [x[0] for r in recs for x in (r["loadavg_before"], r["loadavg_after"]) if x]
        for k, v in vals.items():
            rows.append({"benchmark": b.script, "figure": k, "median": statistics.median(v), "min": min(v),
                         "max": max(v), "n": len(v), "target": _target(b, k),
                         "load_1min": [min(loads), max(loads)] if loads else None,
                         "runs_ok": sum(1 for r in recs if r["rc"] == 0), "runs": len(recs)})
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        f"Measured {meta['date']} on {m.get('cpu', '?')}, {m.get('cores')} cores, "
        f"{m.get('memory_gib', '?')} GiB ({m.get('platform')}); load average (1 min) "
        f"{meta['load_min']:.1f}-{meta['load_max']:.1f} during the runs; "
        f"`python benchmarks/run_all.py{' --quick' if meta['quick'] else ''} --reps {meta['reps']}` "
        f"({meta['seconds'] / 60:.0f} min). Median over the repetitions (n), range = min-max across them.",
        "",
        "| benchmark | figure | median | range | n | load | target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        load = "-" if r["load_1min"] is None else f"{r['load_1min'][0]:.1f}-{r['load_1min'][1]:.1f}"
        lines.append(f"| `{r['benchmark']}` | {r['figure']} | {_num(r['median'])} | "
                     f"{_num(r['min'])} .. {_num(r['max'])} | {r['n']} | {load} | {r['target']} |")
    if meta["failed"]:
        lines += ["", "Could not measure: " + "; ".join(f"{k} ({v})" for k, v in meta["failed"].items())]
    return "\n".join(lines) + "\n"


DIAGNOSTIC = ("flagged pairs", "flagged repetitions")  # counts that explain a figure, not figures


def _meets(target: str, v: float) -> bool | None:
    """Whether ``v`` meets a target written as "<= 2 %", "< 1 % (...)", ">= 1.3x"; None
    for targets that are not a bound ("all", "~1", "")."""
    m = re.match(r"\s*(<=|>=|<|>)\s*([-+0-9.]+)", target)
    if not m:
        return None
    op, bound = m.group(1), float(m.group(2))
    return {"<=": v <= bound, ">=": v >= bound, "<": v < bound, ">": v > bound}[op]


def chance_inside(n_prev: int, n_now: int, draws: int = 20000) -> float:
    """Probability that the median of ``n_now`` draws lies inside the min-max of ``n_prev``
    other draws of the same distribution: what a perfectly reproducible figure scores
    (0.60 for 3 and 3, 0.83 for 5 and 5). Monte Carlo with a fixed seed."""
    if n_prev < 2:
        return 0.0
    rng = random.Random(0)
    hits = 0
    for _ in range(draws):
        prev = [rng.random() for _ in range(n_prev)]
        hits += min(prev) <= statistics.median(rng.random() for _ in range(n_now)) <= max(prev)
    return hits / draws


def compare(rows: list[dict[str, Any]], previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every figure in both runs: is this run's median inside the previous run's range,
    do the two ranges overlap, and does the target verdict (met / not met) come back?"""
    prev = {(r["benchmark"], r["figure"]): r for r in previous}
    out = []
    for r in rows:
        p = prev.get((r["benchmark"], r["figure"]))
        if p is None or any(d in r["figure"] for d in DIAGNOSTIC):
            continue
        then, now = _meets(r["target"], p["median"]), _meets(r["target"], r["median"])
        out.append({"benchmark": r["benchmark"], "figure": r["figure"], "median": r["median"],
                    "min": r["min"], "max": r["max"], "previous_median": p["median"],
                    "previous_min": p["min"], "previous_max": p["max"],
                    "inside": p["min"] <= r["median"] <= p["max"],
                    "overlap": r["min"] <= p["max"] and p["min"] <= r["max"],
                    "chance_inside": 1.0 if p["min"] == p["max"] == r["min"] == r["max"]
                    else chance_inside(p["n"], r["n"]),
                    "target": r["target"], "verdict_then": then, "verdict_now": now,
                    "verdict_same": None if then is None else then == now})
    return out


def compare_markdown(cmp: list[dict[str, Any]], path: Path) -> str:
    inside = sum(c["inside"] for c in cmp)
    expected = sum(c["chance_inside"] for c in cmp)
    overlap = sum(c["overlap"] for c in cmp)
    judged = [c for c in cmp if c["verdict_same"] is not None]
    same = sum(c["verdict_same"] for c in judged)

    def verdict(v: bool | None) -> str:
        return "" if v is None else "met" if v else "NOT met"

    lines = [f"Rerun vs `{path}`: {inside} of {len(cmp)} medians inside the previous run's range "
             f"(a perfectly reproducible benchmark with these repetition counts would score about "
             f"{expected:.0f}: the median of a few draws often falls outside the min-max of a few others); "
             f"{overlap} of {len(cmp)} ranges overlap; the target verdict came back for {same} of "
             f"{len(judged)} figures with a target.", "",
             "| benchmark | figure | median now | range now | previous median | previous range | inside | "
             "overlap | target | verdict then / now |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| `{c['benchmark']}` | {c['figure']} | {_num(c['median'])} | {_num(c['min'])} .. {_num(c['max'])} | "
              f"{_num(c['previous_median'])} | {_num(c['previous_min'])} .. {_num(c['previous_max'])} | "
              f"{'yes' if c['inside'] else 'NO'} | {'yes' if c['overlap'] else 'NO'} | {c['target']} | "
              + (f"{verdict(c['verdict_then'])} / {verdict(c['verdict_now'])}" if c["verdict_then"] is not None else "")
              + " |" for c in cmp]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every benchmark's --quick (CI-sized)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every benchmark (default 3)")
    ap.add_argument("--only", action="append", choices=[b.name for b in BENCHES], help="this benchmark only")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="folder for measured.md / .json")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per benchmark run")
    ap.add_argument("--compare", type=Path, help="a previous measured.json: is every median inside its range?")
    ap.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                    help="measure nothing: one table from the runs of these measured.json files "
                         "(e.g. --only parts run side by side)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    benches = [b for b in BENCHES if not args.only or b.name in args.only]
    t0 = time.time()
    records: list[dict[str, Any]] = []
    if args.combine:
        parts = [json.loads(f.read_text()) for f in args.combine]
        records = [r for part in parts for r in part["runs"]]
        have = {r["benchmark"] for r in records}
        benches = [b for b in benches if b.name in have]
        args.reps = max(part["meta"]["reps"] for part in parts)
        args.quick = all(part["meta"]["quick"] for part in parts)
        t0 -= max(part["meta"]["seconds"] for part in parts)
    for rep in range(0 if args.combine else args.reps):
        for b in benches:
            if b.internal_reps and rep > 0:
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {b.script} (repetition {rep + 1}/{args.reps}"
                  f"{', pairs inside' if b.internal_reps else ''}), load {loadavg()}", flush=True)
            rec = run_one(b, args.quick, args.reps, args.timeout)
            records.append(rec)
            print(f"    {rec['seconds']:.0f} s, exit {rec['rc']}" + (f": {rec['error'][:300]}" if "error" in rec else ""),
                  flush=True)
    rows = table(records, benches)
    loads = [x[0] for r in records for x in (r["loadavg_before"], r["loadavg_after"]) if x]
    failed = {b.name: next((r["error"][:600] for r in records if r["benchmark"] == b.name and "error" in r), "")
              for b in benches if all(r["rc"] != 0 for r in records if r["benchmark"] == b.name)}
    for b in failed:  # a script that measured some of its figures says so
        if any(r["values"] for r in records if r["benchmark"] == b):
            failed[b] = "partly: " + failed[b]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": parts[0]["meta"]["machine"] if args.combine else machine(), "quick": args.quick, "reps": args.reps, "seconds": time.time() - t0,
            "load_min": min(loads) if loads else float("nan"), "load_max": max(loads) if loads else float("nan"),
            "failed": failed}
    md = markdown(rows, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "measured.md").write_text(md)
    (args.out / "measured.json").write_text(json.dumps({"meta": meta, "table": rows, "runs": records}, indent=2))
    print()
    print(md)
    if args.compare:
        cmp = compare(rows, json.loads(args.compare.read_text())["table"])
        cmd = compare_markdown(cmp, args.compare)
        (args.out / "rerun.md").write_text(cmd)
        print(cmd)
    print(f"written: {args.out / 'measured.md'}, {args.out / 'measured.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
