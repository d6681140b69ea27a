"""Regenerate docs/results.md from the benchmarks' JSON, or run the benchmarks first.

    python benchmarks/run_all.py                      # docs/results.md from benchmarks/results/*.json
    python benchmarks/run_all.py --check              # exit 1 if docs/results.md is out of date
    python benchmarks/run_all.py --run [--quick] [--reps N] [--only NAME ...]

Without ``--run`` nothing is measured: every JSON file in ``benchmarks/results/`` becomes
one section of the page, with the command that produced it, its date, the machine, the
load average and the noise floor wherever the JSON records them ("not recorded" where
it does not). The page is the one place the documentation takes measured figures from.

With ``--run`` each benchmark is run first and its JSON in ``benchmarks/results/``
replaced (a run that writes no JSON leaves the previous file in place). Two kinds:

* the *repeated set* (predictor, simulator, scheduler, detector, reconfigure, e2e) runs
  ``--reps`` times as separate processes, interleaved (repetition 1 of every script,
  then repetition 2, ...) so a change of the machine's load hits all of them alike;
  every figure is the median over the repetitions with the min-max range, written to
  ``measured.json`` (``measured-quick.json`` with ``--quick``; ``e2e.py`` repeats its paired
  comparisons itself, ``--reps``);
* *single runs* (:data:`SOURCES`): one configuration of one script each, one JSON file
  each (peers, soak, reconfigure variants, ...). ``--run`` runs the full-size ones,
  ``--run --quick`` the CI-sized ones; those that need a GPU are skipped without one.

``run_all.py`` adds a ``_run`` record (command, date, machine, load average before and
after, seconds, exit status) to every JSON file it writes. ``--compare OLD.json``
compares a fresh ``measured.json`` with an earlier one (whether each median lies inside
the earlier range), written to ``rerun.md`` next to it. Exit status 1 if a benchmark
could not measure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PAGE = ROOT / "docs" / "results.md"
sys.path.insert(0, str(HERE))

from benchstats import loadavg, machine  # noqa: E402

Values = dict[str, list[float]]  # figure -> values (one per repetition, or per pair)
JSON = dict[str, Any]  # a benchmark's JSON document, as parsed


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
        f"`python benchmarks/run_all.py --run{' --quick' if meta['quick'] else ''} --reps {meta['reps']}` "
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


# ---------------------------------------------------------------------------------------
# Single runs: one configuration of one script, one JSON file each.


@dataclass(frozen=True)
class Source:
    """One configuration of one benchmark script whose latest JSON the page shows."""

    name: str  # for --only
    file: str  # its JSON in benchmarks/results/
    script: str
    args: tuple[str, ...]
    title: str  # what it measures, one line
    quick: bool = False  # CI-sized: run by --run --quick (the others by --run)
    needs_gpu: bool = False

    def command(self, results: Path = RESULTS) -> str:
        out = results / self.file
        shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
        return shlex.join(["python", f"benchmarks/{self.script}", *self.args, "--json", str(shown)])


PEERS_TRACES = ("--traces", "none,kill-every-n,one-kill,slow", "--iterations", "30", "--every", "10",
                "--run-timeout", "240")
SOURCES = [
    Source("detector-quick", "detector-quick.json", "detector.py", ("--quick",),
           "Detector: false alarms, accuracy and latency on traces, overhead, slowdowns made outside the "
           "injector", quick=True),
    Source("detector-external-load", "detector-external-load.json", "detector_external.py",
           ("--quick", "--outside-load", "0,1,2"),
           "Fail-slow detector on slowdowns made outside the job at outside load 0, 1x and 2x the cores: "
           "misses, false reports, latency, precision and recall"),
    Source("detector-external-neighbour", "detector-external-neighbour.json", "detector_external.py",
           ("--runs", "2", "--outside-load", "0,1,2", "--cases", "noisy neighbour,whole-machine,no fault"),
           "Fail-slow detector: issue #33's noisy neighbour (a worker pinned to a core shared with busy loops, "
           "its peer unpinned; pinned from the start, and pinned at the onset as users did) next to whole-machine "
           "load and no fault, at outside load 0, 1x and 2x the cores"),
    Source("detector-external-neighbour-quiet", "detector-external-neighbour-quiet.json", "detector_external.py",
           ("--runs", "2", "--outside-load", "0,1,2", "--cases", "noisy neighbour,whole-machine,no fault"),
           "Fail-slow detector: the noisy neighbour cases, whole-machine load and no fault (2 and 4 replicas) at "
           "unpinned outside load 0, 1x and 2x the cores, on a machine with nothing else running"),
    Source("detector-external-start", "detector-external-start.json", "detector_external.py",
           ("--runs", "2", "--cases", "from start,fault (4", "--outside-load", "0,1,2"),
           "Fail-slow detector: one of four DP replicas 3x slower from the job's first iteration (its warm-up "
           "slow too), next to four replicas with no fault, at outside load 0, 1x and 2x the cores"),
    Source("detector-external-onset", "detector-external-onset.json", "detector_external.py",
           ("--quick", "--cases", "pinned at the onset,no fault", "--outside-load", "0,1,2"),
           "Fail-slow detector: issue #33's noisy neighbour as users make it (every worker unpinned until the "
           "onset, then worker 0 pinned to a core where two busy loops start) next to a no-fault run, at outside "
           "load 0, 1x and 2x the cores"),
    Source("detector-external-pinned", "detector-external-pinned.json", "detector_external.py",
           ("--outside-pinned", "--outside-load", "0,1,2", "--runs", "2", "--cases",
            "pinned CPU hog,noisy neighbour,whole-machine,no fault"),
           "Fail-slow detector: a busy-loop neighbour on one worker's core (three ways) next to whole-machine load "
           "and no fault, with the outside load pinned evenly to every core (k busy processes per core, which the "
           "scheduler cannot move onto the neighbour's peers), at outside load 0, 1x and 2x the cores"),
    Source("peers-quick", "peers-quick.json", "peers.py", ("--quick",),
           "ResiHP next to torchft and checkpoint-restart, CI-sized (DP4, fault-free and kill-every-n)", quick=True),
    Source("peers-full", "peers-full.json", "peers.py",
           ("--reps", "3", "--jobs", "dp4,pp2dp2,tp2pp2", *PEERS_TRACES, "--max-wall-s", "2700"),
           "ResiHP next to torchft and checkpoint-restart: three jobs, four failure traces"),
    Source("peers-slow", "peers-slow.json", "peers.py",
           ("--reps", "3", "--jobs", "dp4,pp2dp2,tp2pp2", "--traces", "slow", "--iterations", "30",
            "--run-timeout", "240", "--max-wall-s", "2400"),
           "ResiHP next to torchft and checkpoint-restart when one device computes 2.22x slower (the payback "
           "rule), three jobs, three rounds on a quiet machine"),
    Source("peers-slow-tp2pp2", "peers-slow-tp2pp2.json", "peers.py",
           ("--reps", "3", "--jobs", "tp2pp2", "--traces", "slow", "--iterations", "30", "--run-timeout", "240",
            "--max-wall-s", "1200"),
           "The slow trace on TP2 x PP2 at 0.13 s steps, with each ResiHP run's reports and payback decisions"),
    Source("peers-slow-m", "peers-slow-m.json", "peers.py",
           ("--reps", "3", "--jobs", "dp4", "--traces", "slow", "--size", "m", "--iterations", "30",
            "--run-timeout", "400", "--max-wall-s", "2000"),
           "The slow trace on DP4 at the step times users have (size m, 0.8 s steps): ResiHP next to torchft "
           "and checkpoint-restart, three rounds on a quiet machine"),
    Source("peers-slow-pp2dp2-m", "peers-slow-pp2dp2-m.json", "peers.py",
           ("--reps", "3", "--jobs", "pp2dp2", "--traces", "slow", "--size", "m", "--iterations", "30",
            "--run-timeout", "400", "--max-wall-s", "1500"),
           "The slow trace on PP2 x DP2 at size m (0.5 s steps): ResiHP next to checkpoint-restart, three "
           "rounds on a quiet machine"),
    Source("peers-slow-tp2pp2-m", "peers-slow-tp2pp2-m.json", "peers.py",
           ("--reps", "3", "--jobs", "tp2pp2", "--traces", "slow", "--size", "m", "--iterations", "30",
            "--run-timeout", "400", "--max-wall-s", "1500"),
           "The slow trace on TP2 x PP2 (reference backend) at size m: ResiHP next to checkpoint-restart, "
           "three rounds on a quiet machine"),
    Source("peers-tp2pp2", "peers-tp2pp2.json", "peers.py",
           ("--reps", "3", "--jobs", "tp2pp2", "--traces", "one-kill,kill-every-n", "--iterations", "30",
            "--every", "10", "--run-timeout", "240"),
           "ResiHP next to checkpoint-restart on TP2 x PP2 (reference backend) under kills"),
    *(Source(f"soak-quick-{a}", f"soak-quick-{a}.json", "soak.py", ("--quick", "--adapter", a),
             f"Soak, 10 random failures, {a} adapter: every committed iteration checked step by step",
             quick=True) for a in ("megatron_ref", "torch_native", "deepspeed")),
    Source("soak-100", "soak-100.json", "soak.py", ("--failures", "100"),
           "Soak, 100 random failures (megatron_ref): every committed iteration checked step by step"),
    Source("soak-sensitivity", "soak-sensitivity.json", "soak_sensitivity.py", (),
           "How fast float64 training amplifies a rounding-level difference (why the soak checks one step at a time)"),
    Source("reconfigure-megatron_core", "reconfigure-megatron_core.json", "reconfigure.py",
           ("--adapter", "megatron_core"),
           "Megatron-Core TP2 x PP2 x DP2 (GPTModel): SIGKILL of a TP member -> first committed iteration"),
    Source("reconfigure-megatron_core-distopt", "reconfigure-megatron_core-distopt.json", "reconfigure.py",
           ("--adapter", "megatron_core", "--distributed-optimizer", "--quick"),
           "Megatron-Core TP2 x PP2 x DP2, distributed optimizer: SIGKILL of a TP member -> first committed iteration",
           quick=True),
    Source("reconfigure-deepspeed-kill", "reconfigure-deepspeed-kill.json", "reconfigure.py",
           ("--adapter", "deepspeed", "--kill-only"),
           "DeepSpeed PP2 x DP2: SIGKILL -> first committed iteration; post-failure iteration vs the best static plan"),
    Source("reconfigure-deepspeed-restore-at", "reconfigure-deepspeed-restore-at.json", "reconfigure.py",
           ("--adapter", "deepspeed", "--restore-at", "30,300"),
           "DeepSpeed ZeRO 1: kill -> the killed iteration recommitted through a checkpoint restore, at 30 and 300"),
    Source("reconfigure-torch_native-restore-at", "reconfigure-torch_native-restore-at.json", "reconfigure.py",
           ("--adapter", "torch_native", "--restore-at", "30,300"),
           "torch_native FSDP2: kill -> the killed iteration recommitted through a checkpoint restore, at 30 and 300"),
    Source("reconfigure-torch_native-fault-free", "reconfigure-torch_native-fault-free.json", "reconfigure.py",
           ("--adapter", "torch_native", "--fault-free-only"),
           "torch_native PP2 x DP2: fault-free iteration time, resilient path vs stock torch, alternated"),
    Source("reconfigure-torch_native-fault-free-dp4", "reconfigure-torch_native-fault-free-dp4.json",
           "reconfigure.py", ("--adapter", "torch_native", "--fault-free-only", "--fault-free-job", "dp4"),
           "torch_native DP4: fault-free iteration time, resilient path vs plain DDP and stock FSDP"),
    Source("reconfigure-torch_native-hf_llama-kill", "reconfigure-torch_native-hf_llama-kill.json",
           "reconfigure.py", ("--adapter", "torch_native", "--model", "hf_llama"),
           "torch_native, the user's HF LLaMA, PP2 x DP2: SIGKILL -> first iteration (HSDP from memory, FSDP2 "
           "from DCP)"),
    Source("reconfigure-torch_native-hf_llama-fault-free", "reconfigure-torch_native-hf_llama-fault-free.json",
           "reconfigure.py", ("--adapter", "torch_native", "--model", "hf_llama", "--fault-free-only"),
           "The user's HF LLaMA script under resihp launch vs accelerate launch: fault-free iteration time"),
    Source("reconfigure-torch_native-tp2", "reconfigure-torch_native-tp2.json", "reconfigure.py",
           ("--adapter", "torch_native", "--tp", "2"),
           "torch_native TP2 x PP2 (HF LLaMA): SIGKILL of a TP member -> first iteration with that group at TP1; "
           "fault-free vs stock"),
    Source("reconfigure-controller-restart", "reconfigure-controller-restart.json", "reconfigure.py",
           ("--controller-restart",), "Controller SIGKILLed and restarted with --resume: re-attach and first iteration"),
    Source("false-reports", "false-reports.json", "false_reports.py", ("--runs", "2"),
           "Fail-slow detector on a loaded machine: false reports and misses per case"),
    Source("false-reports-hog-all", "false-reports-hog-all.json", "false_reports.py",
           ("--cases", "hog-all", "--runs", "8"),
           "No-fault runs with a busy loop on every core from iteration 12 (the load every rank shares): "
           "fail-slow false reports"),
    Source("false-reports-nofault", "false-reports-nofault.json", "false_reports.py",
           ("--cases", "no-load,steady-load,cpu-burst", "--runs", "1"),
           "No-fault runs of the reference backend's TP1 x PP2 x DP2 job: fail-slow and SDC false reports"),
    Source("engine-cpu-m", "engine-cpu-m.json", "engine_cpu.py",
           ("--size", "m", "--iterations", "16", "--rounds", "2", "--threads", "1"),
           "The torch_native engine's iteration at size m in one process, one thread, by part: the rollback "
           "snapshot, the SDC fingerprint as a separate pass and read during the snapshot's copy"),
    Source("sdc-cost-dp4-m", "sdc-cost-dp4-m.json", "sdc_cost.py",
           ("--job", "dp4", "--size", "m", "--job-rounds", "6", "--iterations", "14"),
           "What the SDC fingerprint costs a real iteration: overhead.py's torch_native DP4 job at size m (0.98 s "
           "steps) with fingerprints on and off, alternating, on a quiet machine"),
    Source("sdc-cost", "sdc-cost.json", "sdc_cost.py",
           ("--sizes", "1e6,4e6,1.6e7", "--rounds", "1,4,8", "--coverage", "0.25,0.1"),
           "SDC checks: a shard's fingerprint (every byte; parameters whole and the optimizer state in R iterations, "
           "the default; partial coverage) and its gradient norm next to an AdamW step of it, and the last "
           "executor's comparison, as shares of a 0.5 s iteration", quick=True),
    Source("control-scale", "control-scale.json", "control_scale.py", ("--ranks", "256,1024", "--commit", "both"),
           "Control plane with the real controller and job store, emulated nodes of 8 ranks over loopback: "
           "commits through the node agent vs each rank to the store itself"),
    Source("control-scale-coroutines", "control-scale-coroutines.json", "control_scale.py",
           ("--ranks", "1024,4096", "--emulation", "coroutines", "--iterations", "8", "--faults", "loss,restart"),
           "Control plane at 1,024 and 4,096 ranks, each emulated rank a coroutine talking to its real agent: a node "
           "lost and a controller restart (stop -> every agent re-attached); the emulators' own CPU per run"),
    Source("control-scale-relay", "control-scale-relay.json", "control_scale.py",
           ("--ranks", "1024,2048", "--emulation", "coroutines", "--iterations", "6", "--faults", "loss",
            "--sample-stacks"),
           "Control plane at 1,024 and 2,048 coroutine ranks with the generation watch and plan relayed by each "
           "node agent: where node loss -> plan read by every rank goes, store connections and parked waits"),
    Source("control-scale-relay-threads256", "control-scale-relay-threads256.json", "control_scale.py",
           ("--ranks", "256", "--emulation", "threads", "--iterations", "5", "--faults", "loss"),
           "Control plane at 256 ranks, a thread and real sockets per rank, generation watch through the agent: "
           "store connections, parked waits and requests per iteration"),
    Source("control-scale-16k", "control-scale-16k.json", "control_scale.py",
           ("--ranks", "16384", "--emulation", "coroutines", "--iterations", "5", "--procs", "4"),
           "Control plane at 16,384 emulated ranks on this machine: what the controller and store cost per "
           "iteration while the emulators, short of cores, stretch the iterations"),
    Source("detector-scale", "detector-scale.json", "detector_scale.py", (),
           "The fail-slow detector's CPU per iteration against the job's ranks (1,024 to 16,384, TP 1 and 8), "
           "in one process on synthetic profiles, then one TP group slowed 2x: its latency and the verification's CPU"),
    Source("store-fanout", "store-fanout.json", "store_fanout.py", ("--nodes", "128,512,2048", "--iterations", "20"),
           "The job store's commit fan-out against the job's nodes (128 to 2,048 node agents, 1,024 to 16,384 "
           "ranks): the completing add to the verdict at every node, the store's CPU per node; torch's TCPStore "
           "(libuv) on the same pattern"),
    Source("scheduler-131072", "scheduler-131072.json", "scheduler.py",
           ("--jobs", "16", "--latency-jobs", "131072", "--runs", "3"),
           "Planning latency at 131,072 GPUs (TP8 PP16 DP1024), cold caches, and one simulated iteration there"),
    Source("control-scale-faults", "control-scale-faults.json", "control_scale.py",
           ("--ranks", "256", "--iterations", "16", "--commit", "agent", "--faults", "loss,silent,slow"),
           "Control plane at 256 ranks, commits through the node agent: a node lost, a node silent (partition), "
           "one rank computing 1.5x: fault -> report -> plan read by every rank, false reports"),
    Source("overhead-dp4-ml", "overhead-dp4-ml.json", "overhead.py",
           ("--jobs", "dp4", "--sizes", "m,l", "--systems", "stock,resihp", "--rounds", "2", "--iterations", "12"),
           "The cost of being resilient at 0.9 s and 3.6 s steps: torch_native DP4 vs plain DDP, the two largest "
           "models, no checkpoints"),
    Source("overhead-dp4-m", "overhead-dp4-m.json", "overhead.py",
           ("--jobs", "dp4", "--sizes", "m", "--systems", "stock,resihp", "--rounds", "5", "--iterations", "14"),
           "The cost of being resilient on DP4 with the step after the commit (no rollback snapshot): "
           "torch_native DP4 vs plain DDP at 0.7 s steps, five alternating rounds, no checkpoints"),
    Source("overhead-dp4-l", "overhead-dp4-l.json", "overhead.py",
           ("--jobs", "dp4", "--sizes", "l", "--systems", "stock,resihp", "--rounds", "3", "--iterations", "10"),
           "The cost of being resilient on DP4 with the step after the commit at 2.8 s steps: torch_native DP4 "
           "vs plain DDP, three alternating rounds, no checkpoints"),
    Source("overhead-m", "overhead-m.json", "overhead.py",
           ("--jobs", "dp4,pp2dp2,tp2pp2", "--sizes", "m", "--rounds", "2", "--iterations", "12"),
           "The cost of being resilient at 0.4-0.9 s steps, every job: torch_native DP4 vs plain DDP, torch_native "
           "PP2 x DP2 vs stock pipelining + FSDP2, megatron_ref TP2 x PP2 vs its torchrun reference; with and "
           "without checkpoints"),
    Source("overhead-ds", "overhead-ds.json", "overhead.py",
           ("--jobs", "ds_pp2dp2", "--sizes", "m,l", "--rounds", "2", "--iterations", "10"),
           "The cost of being resilient on DeepSpeed: the user's GPT pipeline (PP2 x DP2) under resihp launch vs "
           "deepspeed.initialize under torchrun, at 0.5-3 s steps, with and without checkpoints"),
    Source("overhead-ds-l", "overhead-ds-l.json", "overhead.py",
           ("--jobs", "ds_pp2dp2", "--sizes", "l", "--systems", "stock,resihp", "--rounds", "3", "--iterations", "10"),
           "The cost of being resilient on DeepSpeed at its largest size, three alternating rounds without "
           "checkpoints: the user's GPT pipeline (PP2 x DP2) under resihp launch vs deepspeed.initialize"),
    Source("overhead-quick", "overhead-quick.json", "overhead.py", ("--quick",),
           "The cost of being resilient, CI-sized: torch_native DP4 vs plain DDP, smallest model, with and "
           "without checkpoints", quick=True),
    Source("overhead", "overhead.json", "overhead.py", (),
           "The cost of being resilient: each adapter vs the stock framework over model sizes, with and without "
           "checkpoints (every iteration; Young/Daly)"),
    Source("dcp-write-cost", "dcp-write-cost.json", "dcp_write_cost.py", (),
           "One torch_native DCP checkpoint write per rank (DP4): wall and CPU seconds"),
    Source("fault-free-profile-dp4", "fault-free-profile-dp4.json", "fault_free_profile.py",
           ("--job", "dp4", "--iterations", "30"),
           "Where a fault-free ResiHP iteration goes (DP4): per-iteration ms by part, CPU by process"),
    Source("fault-free-profile-pp2dp2", "fault-free-profile-pp2dp2.json", "fault_free_profile.py",
           ("--job", "pp2dp2", "--iterations", "30", "--clock", "thread", "--stock"),
           "Where a fault-free ResiHP iteration goes (PP2 x DP2) next to stock torch, thread CPU clock"),
    Source("engine-cpu", "engine-cpu.json", "engine_cpu.py", (),
           "CPU per iteration of the torch_native engine vs a plain DDP step, one process"),
    Source("checkpoint-quick", "checkpoint-quick.json", "checkpoint.py", ("--quick",),
           "What a checkpoint costs: bytes, training-thread time, writer time, verification", quick=True),
    Source("cluster-quick", "cluster-quick.json", "cluster.py", ("--quick",),
           "Cluster scale, simulated: retained throughput per policy and scenario", quick=True),
    Source("data-detector-quick", "data-detector-quick.json", "data_detector.py", ("--quick",),
           "Fail-slow false alarms on a real corpus's length fluctuation", quick=True),
    Source("group-creation", "group-creation.json", "group_creation.py", (),
           "gloo process groups against world size (2-32 ranks on this host): world, new_group, pairs, split, "
           "shrink; medians and fitted growth"),
    Source("gpu-check", "gpu-check.json", "gpu_check.py", (),
           "One prepared check on this machine's GPUs: kills, slowdown, NCCL, predictor", needs_gpu=True),
]


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def run_source(s: Source, results: Path, timeout: float) -> str | None:
    """Run one single-run benchmark and replace its JSON; the error text, or None."""
    fd, tmp = tempfile.mkstemp(suffix=".json", prefix=f"resihp-{s.name}-")
    os.close(fd)
    Path(tmp).unlink()
    cmd = [sys.executable, str(HERE / s.script), *s.args, "--json", tmp]
    load0, t0 = loadavg(), time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        rc, err = p.returncode, p.stderr[-1500:]
    except subprocess.TimeoutExpired:
        rc, err = -1, f"timed out after {timeout:.0f} s"
    try:
        data = json.loads(Path(tmp).read_text())
    except (OSError, ValueError) as e:
        return f"no JSON ({e}); exit {rc}: {err}"
    finally:
        Path(tmp).unlink(missing_ok=True)
    if isinstance(data, dict):
        data["_run"] = {"command": s.command(results), "date": _utc(t0), "machine": machine(),
                        "loadavg_before": load0, "loadavg_after": loadavg(),
                        "seconds": round(time.time() - t0, 1), "exit": rc}
    (results / s.file).write_text(json.dumps(data, indent=2) + "\n")
    return None if rc == 0 else f"exit {rc} (JSON kept): {err}"


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---------------------------------------------------------------------------------------
# The page: one section per JSON file.

META_KEYS = {"_run", "command", "date", "machine", "loadavg", "loadavg_end", "load", "config", "markdown", "meta",
             "wall_s", "seconds", "what", "commands"}
NOT_RECORDED = "not recorded"
REPEATED_TITLE = ("The repeated set (predictor, simulator, scheduler, detector, reconfigure, e2e): median and "
                  "min-max range over interleaved repetitions")
MAX_ROWS = 30  # rows of one table; the rest stay in the JSON
MAX_COLS = 14
MAX_FIGURES = 100  # single figures of one section; the rest stay in the JSON
FIRST_KEYS = ("summary", "targets", "overhead", "ok", "problems")


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "-"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.2e}"
        return _num(v)
    if v is None:
        return "-"
    if isinstance(v, list) and len(v) <= 4 and all(_scalar(x) for x in v):
        return ", ".join(_fmt(x) for x in v) if v else "-"
    text = str(v).replace("\n", " ").replace("|", "/")
    return text if len(text) <= 90 else text[:87] + "..."


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 90)


def _cell(v: Any) -> bool:
    """Whether ``v`` fits in a table cell (a scalar or a short list of scalars)."""
    return _scalar(v) or (isinstance(v, list) and len(v) <= 4 and all(_scalar(x) for x in v))


def _load_text(v: Any) -> str | None:
    """A load-average record (three readings, or a list of 1-min readings) as 'A-B'."""
    if not isinstance(v, list) or not v:
        return None
    nums: list[float] = []
    for x in v:
        x = x[0] if isinstance(x, list) and x else x
        try:
            nums.append(float(x))
        except (TypeError, ValueError):
            return None
    lo, hi = min(nums), max(nums)
    return f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"


def _machine_text(m: Any) -> str | None:
    if isinstance(m, str):
        return m
    if not isinstance(m, dict):
        return None
    parts = []
    if m.get("gpus"):
        parts.append(", ".join(str(g) for g in m["gpus"]))
    if m.get("cpu"):
        parts.append(str(m["cpu"]))
    if m.get("cores"):
        parts.append(f"{m['cores']} cores")
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB")
    for k in ("torch", "cuda_build", "python", "platform"):
        if m.get(k):
            parts.append(f"{k} {m[k]}")
    return ", ".join(parts) or None


def run_meta(d: JSON) -> dict[str, str]:
    """Command, date, machine, load and noise floor of one JSON file, each
    :data:`NOT_RECORDED` where the file does not say."""
    run = d.get("_run") if isinstance(d.get("_run"), dict) else {}
    meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
    config = d.get("config") if isinstance(d.get("config"), dict) else {}
    m = run.get("machine") or d.get("machine") or meta.get("machine")
    date = run.get("date") or d.get("date") or meta.get("date") or (m.get("date_utc") if isinstance(m, dict) else None)
    command = run.get("command") or d.get("command")
    if not command and "table" in d and "quick" in meta:  # run_all.py's own repeated set
        only = "".join(f" --only {n}" for n in meta.get("only") or [])
        command = f"python benchmarks/run_all.py --run{' --quick' if meta['quick'] else ''} --reps {meta.get('reps')}{only}"
    load = None
    if run.get("loadavg_before") or run.get("loadavg_after"):
        load = _load_text([x for x in (run.get("loadavg_before"), run.get("loadavg_after")) if x])
    if load is None and "load_min" in meta:
        load = _load_text([meta["load_min"], meta["load_max"]])
    for v in (d.get("loadavg"), d.get("load"), config.get("loadavg")):
        if load is None:
            load = _load_text(v)
    if load is None:  # per-case load readings (false_reports.py, detector_external.py)
        cases = d.get("cases") if isinstance(d.get("cases"), dict) else {}
        readings = [x for c in cases.values() if isinstance(c, dict) for x in (c.get("load") or [])]
        load = _load_text(readings)
    floors = []
    for k, v in d.items():  # the script's own noise figures, top level and one level down
        subs = v.items() if isinstance(v, dict) else [("", v)]
        for k2, v2 in subs:
            name = f"{k}.{k2}" if k2 else k
            if re.search(r"floor|noise", name) and isinstance(v2, (int, float)) and not isinstance(v2, bool):
                floors.append(f"{name} {_fmt(v2)}")
    for r in d.get("table") or []:  # run_all.py's repeated set
        if isinstance(r, dict) and "floor" in str(r.get("figure", "")) and isinstance(r.get("median"), (int, float)):
            floors.append(f"{r.get('benchmark')} {r['figure']} {_fmt(r['median'])}")
    wall = run.get("seconds") or d.get("wall_s") or d.get("seconds") or meta.get("seconds")
    return {"command": command or NOT_RECORDED, "date": date or NOT_RECORDED,
            "machine": _machine_text(m) or NOT_RECORDED,
            "load": f"1-min load average {load}" if load else NOT_RECORDED,
            "noise floor": "; ".join(floors) or NOT_RECORDED,
            "wall": f"{float(wall):.0f} s" if isinstance(wall, (int, float)) else NOT_RECORDED}


def _table(rows: dict[str, dict[str, Any]], first: str) -> list[str]:
    cols: list[str] = []
    for r in rows.values():
        for k, v in r.items():
            if k not in cols and _cell(v):
                cols.append(k)
    cols = cols[:MAX_COLS]
    out = [f"| {first} | " + " | ".join(cols) + " |", "| --- " * (len(cols) + 1) + "|"]
    for name, r in list(rows.items())[:MAX_ROWS]:
        out.append(f"| {name} | " + " | ".join(_fmt(r.get(c)) if _cell(r.get(c)) else "" for c in cols) + " |")
    if len(rows) > MAX_ROWS:
        out.append(f"\n({len(rows) - MAX_ROWS} more rows in the JSON.)")
    return out


def _row_name(r: dict[str, Any], i: int) -> str:
    for k in ("scenario", "name", "case", "job", "kind", "failure", "benchmark"):
        if isinstance(r.get(k), str):
            return r[k]
    return str(i)


def figures(d: JSON) -> list[str]:
    """The figures of one JSON document as markdown: scalars as a figure | value table,
    dicts of records and lists of records as tables of their own."""
    flat: list[tuple[str, Any]] = []
    blocks: list[list[str]] = []

    def walk(prefix: str, v: Any, depth: int) -> None:
        if _cell(v):
            flat.append((prefix, v))
        elif isinstance(v, dict) and len(v) > MAX_ROWS:
            flat.append((prefix, f"{len(v)} entries (in the JSON)"))
        elif isinstance(v, dict) and v:
            recs = [x for x in v.values() if isinstance(x, dict)]
            if len(recs) == len(v) and len(v) >= 2 and all(any(_cell(y) for y in x.values()) for x in recs):
                blocks.append([f"**{prefix}**", ""] + _table(v, prefix.rsplit(".", 1)[-1]))
            elif depth < 3:
                for k, x in v.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), x, depth + 1)
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            names = [_row_name(x, i) for i, x in enumerate(v)]
            if len(set(names)) < len(names):  # repeated names (a soak's failure kinds): number them
                names = [f"{i + 1}: {n}" for i, n in enumerate(names)]
            blocks.append([f"**{prefix}**", ""] + _table(dict(zip(names, v)), "row"))

    first = [k for k in FIRST_KEYS if k in d]  # a script's own summary leads its section
    for k in first + [k for k in d if k not in first]:
        if k not in META_KEYS and not k.startswith("_"):
            walk(str(k), d[k], 1)
    out: list[str] = []
    if flat:
        out += ["| figure | value |", "| --- | --- |"]
        out += [f"| {k} | {_fmt(v)} |" for k, v in flat[:MAX_FIGURES]]
        if len(flat) > MAX_FIGURES:
            out.append(f"\n({len(flat) - MAX_FIGURES} more figures in the JSON.)")
    for b in blocks:
        out += [""] + b
    return out


def _demote(md: str) -> str:
    """A benchmark's own markdown report inside a section: its headings one level down."""
    return "\n".join("###" + ln if ln.startswith("#") else ln for ln in md.splitlines())


def section(path: Path, d: Any, sources: dict[str, Source]) -> list[str]:
    s = sources.get(path.name)
    out = [f"## `{path.name}`", ""]
    if s or _repeated(path.name) or _own_title(d):
        out += [(s.title if s else REPEATED_TITLE if _repeated(path.name) else _own_title(d)) + ".", ""]
    if isinstance(d, str):  # the parse error
        return out + [d, ""]
    if not isinstance(d, dict):
        return out + [f"Not a JSON object ({type(d).__name__}): nothing to show.", ""]
    meta = run_meta(d)
    if meta["noise floor"] == NOT_RECORDED and "noise floor" in str(d.get("markdown", "")):
        meta["noise floor"] = "per system, in the tables below"
    if meta["command"] == NOT_RECORDED and s:
        meta["command"] = f"{NOT_RECORDED} (`run_all.py --run` runs `{s.command()}`)"
    else:
        meta["command"] = f"`{meta['command']}`" if meta["command"] != NOT_RECORDED else NOT_RECORDED
    out += [f"- {k}: {v}" for k, v in meta.items()]
    if isinstance(d.get("_run"), dict) and d["_run"].get("source"):
        out.append(f"- note: {d['_run']['source']}")
    out.append("")
    if isinstance(d.get("table"), list) and isinstance(d.get("meta"), dict):  # run_all.py's repeated set
        rows, m = d["table"], d["meta"]
        out += ["| benchmark | figure | median | range | n | load | target |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            load = "-" if not r.get("load_1min") else f"{r['load_1min'][0]:.1f}-{r['load_1min'][1]:.1f}"
            out.append(f"| `{r['benchmark']}` | {r['figure']} | {_num(r['median'])} | {_num(r['min'])} .. "
                       f"{_num(r['max'])} | {r['n']} | {load} | {r.get('target', '')} |")
        if m.get("failed"):
            out += ["", "Could not measure: " + "; ".join(f"{k} ({v})" for k, v in m["failed"].items())]
    elif isinstance(d.get("markdown"), str):  # the script's own report (peers.py)
        out += [_demote(d["markdown"])]
    else:
        out += figures(d)
    return out + [""]


def _own_title(d: Any) -> str:
    """The title a one-off JSON (an A/B kept beside the registered ones, not re-run by
    ``--run``) gives itself in its ``title`` field; "" if none."""
    return d["title"] if isinstance(d, dict) and isinstance(d.get("title"), str) else ""


def _repeated(name: str) -> bool:
    return name in ("measured.json", "measured-quick.json")


def generate(results: Path = RESULTS, sources: list[Source] | None = None) -> str:
    """docs/results.md's text from every ``*.json`` under ``results``."""
    by_file = {s.file: s for s in (SOURCES if sources is None else sources)}
    files = sorted(results.glob("*.json"))
    lines = [
        "# Measured results",
        "",
        "Generated by `python benchmarks/run_all.py` from the JSON files in `benchmarks/results/`; do not edit by",
        "hand. Each section is one benchmark configuration's latest run: the command that produced it, when, on",
        "what machine, under what load, and its noise floor where the benchmark records one. How each benchmark",
        "measures and how to read its figures: [benchmarks.md](benchmarks.md).",
        "",
    ]
    lines += ["| file | what it measures | date |", "| --- | --- | --- |"]
    parsed: list[tuple[Path, Any]] = []
    for f in files:
        try:
            d: Any = json.loads(f.read_text())
        except ValueError as e:
            d = f"unreadable JSON: {e}"
        parsed.append((f, d))
        s = by_file.get(f.name)
        title = s.title if s else REPEATED_TITLE if _repeated(f.name) else _own_title(d) or "not a registered benchmark"
        date = run_meta(d)["date"] if isinstance(d, dict) else NOT_RECORDED
        anchor = re.sub(r"[^a-z0-9 _-]", "", f.name.lower()).replace(" ", "-")
        lines.append(f"| [`{f.name}`](#{anchor}) | {title} | {date} |")
    lines.append("")
    missing = [s for s in (SOURCES if sources is None else sources) if not (results / s.file).exists()]
    if missing:
        lines += ["Not measured yet (no JSON): " + "; ".join(f"`{s.command()}`" for s in missing), ""]
    for f, d in parsed:
        lines += section(f, d, by_file)
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------


def run_repeated(benches: list[Bench], args: argparse.Namespace) -> int:
    """The repeated set: ``--reps`` interleaved repetitions, ``measured.json``."""
    t0 = time.time()
    records: list[dict[str, Any]] = []
    parts: list[JSON] = []
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
    for name in failed:  # a script that measured some of its figures says so
        if any(r["values"] for r in records if r["benchmark"] == name):
            failed[name] = "partly: " + failed[name]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": parts[0]["meta"]["machine"] if parts else machine(), "quick": args.quick,
            "reps": args.reps, "only": [b.name for b in benches] if args.only else None, "seconds": time.time() - t0,
            "load_min": min(loads) if loads else float("nan"), "load_max": max(loads) if loads else float("nan"),
            "failed": failed}
    md = markdown(rows, meta)
    args.results.mkdir(parents=True, exist_ok=True)
    name = "measured-quick.json" if args.quick else "measured.json"  # one file per size: the latest of each
    (args.results / name).write_text(json.dumps({"meta": meta, "table": rows, "runs": records}, indent=2) + "\n")
    print()
    print(md)
    if args.compare:
        cmp = compare(rows, json.loads(args.compare.read_text())["table"])
        text = compare_markdown(cmp, args.compare)
        (args.results / "rerun.md").write_text(text)
        print(text)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run the benchmarks first (their JSON is replaced)")
    ap.add_argument("--quick", action="store_true", help="with --run: the CI-sized configurations")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the repeated set (default 3)")
    names = [b.name for b in BENCHES] + [s.name for s in SOURCES]
    ap.add_argument("--only", action="append", choices=names, metavar="NAME",
                    help=f"with --run: this benchmark only (repeatable); one of {', '.join(names)}")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the JSON folder (default benchmarks/results)")
    ap.add_argument("--out", type=Path, default=PAGE, help="the page to write (default docs/results.md)")
    ap.add_argument("--check", action="store_true", help="write nothing: exit 1 if the page is out of date")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds allowed per benchmark run")
    ap.add_argument("--compare", type=Path, help="with --run: an earlier measured.json, is every median inside its range?")
    ap.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                    help="measure nothing: one measured.json from the runs of these measured.json files")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if (args.quick or args.only or args.compare) and not (args.run or args.combine):
        ap.error("--quick, --only and --compare go with --run (or --combine)")
    rc = 0
    if args.run or args.combine:
        benches = [b for b in BENCHES if not args.only or b.name in args.only]
        if benches:
            rc |= run_repeated(benches, args)
        gpu = _has_gpu()
        for s in SOURCES:
            if args.combine or (args.only and s.name not in args.only) or (not args.only and s.quick != args.quick):
                continue
            if s.needs_gpu and not gpu:
                print(f"{s.name}: skipped, no GPU here", flush=True)
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {s.command(args.results)}, load {loadavg()}", flush=True)
            err = run_source(s, args.results, args.timeout)
            if err:
                print(f"    {s.name}: {err[:600]}", flush=True)
                rc = 1
    text = generate(args.results)
    if args.check:
        now = args.out.read_text() if args.out.exists() else ""
        if now != text:
            print(f"{args.out} is out of date: run python benchmarks/run_all.py", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return rc
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written: {args.out} ({len(text.splitlines())} lines, {len(list(args.results.glob('*.json')))} JSON files)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
