"""Fail-slow detection of slowdowns made from outside the job (docs/detector.md), next to
the injector's: real processes on this machine.

Each case runs a controller with the default fail-slow detector, one node agent and DP
replicas of :mod:`resihp_core.testing.synthetic` workers in ``--busy`` mode (their
compute is a fixed amount of CPU work, so other processes on their core, a SIGSTOP or
a throttle lengthen it as they would a trainer's), each pinned to a core of its own
(``os.sched_setaffinity``, every thread; replicas share cores round-robin when there
are more replicas than cores). Cases:

* **pinned CPU hog** — three busy processes pinned to worker 0's core from the onset
  (started and held before the job, released at the onset: :class:`~resihp_core.testing.hogs.CpuHogs`);
* **noisy neighbour** — the same hog, but only worker 0 is pinned (to that core): its
  peer runs unpinned, free to move off the busy core (issue #33's neighbour);
* **noisy neighbour pinned at the onset** — as users made it in issue #33: every worker
  runs unpinned until the onset, then worker 0 is pinned (every thread, as ``taskset -a
  -p``) to a core where two busy loops start;
* **duty-cycled SIGSTOP** — worker 1 stopped half of every cycle from the onset, the
  cycle a quarter of its healthy compute (20 ms at least), so every iteration is stopped
  about half of its time;
* **whole-machine load** — three busy processes pinned to *every* worker's core, released
  on every core at once: every replica slowed alike, which must not be reported;
* **small / large model** — the injector's way (``--slow-compute 1.5``): 1.5x slower
  compute of worker 1, iterations of ~0.05 s and ~0.5 s of compute;
* **DP-only** — four replicas, one 3x slower (injected);
* **DP-only from the start** — four replicas, one 3x slower from the job's first
  iteration (injected): its warm-up is slow too, so only its peers show it; its onset
  (for the latency) is the first iteration the fitted model judges;
* **no fault** — nothing slowed: any report is false (two replicas, and four, whose
  warm-up is compared among peers).

``--outside-load 0,1,2`` runs every case at each outside load, given as busy processes
per core (not pinned: the scheduler places them, as other users' jobs on a shared
host), started before the job and running through it, its warm-up included: 1 is one
busy process per core, 2 twice the cores. With ``--outside-pinned`` that many are
pinned to each core instead: the scheduler can no longer move the outside load onto
the neighbour's peers, so the neighbour's own share of the slowdown stays its own. Precision (reports naming the slowed device
over all reports) and recall (slowdowns reported over slowdowns made) are counted per
load and over all runs.

Per case: runs, misses (no report naming the slowed device), false reports (reports
naming any other device, or any report where nothing must be reported) and latency in
iterations (from the onset to the report, the onset included; for the external cases
the onset is the second iteration after the controller saw the one before it complete:
the replicas are already computing the next one when the slowdown starts).

    python benchmarks/detector_external.py [--quick] [--outside-load 0,1,2] [--cases NAME,..] [--json PATH]
        [--trace DIR]

``--trace DIR`` writes one JSON-lines file per run: every iteration's per-device compute,
run delay in compute and CPUs, and every detection that was not "none" (its action,
rule and evidence), for reading why a case was missed or falsely reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from resihp_core.config import DetectorConfig  # noqa: E402
from resihp_core.detector.failslow import build_failslow_detector  # noqa: E402
from resihp_core.detector.localise import compute_of  # noqa: E402
from resihp_core.testing.duty import duty_cycle, duty_period  # noqa: E402
from resihp_core.testing.hogs import CpuHogs  # noqa: E402
from resihp_core.testing.outside_load import OutsideLoad  # noqa: E402
from resihp_core.testing.synthetic import SyntheticCluster  # noqa: E402

ONSET = 12  # warm-up (1 skipped + 3 fitted) and healthy per-device history before it
JUDGED = 4  # the first iteration the fitted model judges (1 skipped + 3 fitted)
AFTER = 10  # iterations watched after the onset
# The detector's defaults, but beats may lapse for long: a busy worker's beat thread
# starved on a loaded core must not be taken for a hang (this measures fail-slow only;
# 10 s was too short at load 50 with a hog on the core: two workers killed as hung).
CONFIG = DetectorConfig(heartbeat_miss_limit=600, hang_min_timeout_s=120.0)


@dataclass(frozen=True)
class Case:
    name: str
    replicas: int
    compute_s: float  # per iteration, healthy
    external: str = ""  # "hog", "neighbour", "neighbour-onset", "hog-all", "duty" or "" (injected or none)
    inject: float = 1.0  # compute factor of ``target`` from ``slow_from`` (the injector's way)
    target: int | None = None  # the device that must be reported (None: nothing)
    slow_from: int = ONSET  # 0: from the job's start (its latency counts from JUDGED)


CASES = (
    Case("pinned CPU hog, one worker's core", 2, 0.15, external="hog", target=0),
    Case("noisy neighbour, its peer unpinned", 2, 0.15, external="neighbour", target=0),
    Case("noisy neighbour pinned at the onset", 2, 0.15, external="neighbour-onset", target=0),
    Case("duty-cycled SIGSTOP 50 %", 2, 0.15, external="duty", target=1),
    Case("whole-machine load, every core", 2, 0.15, external="hog-all"),
    Case("small model, 1.5x (injected)", 2, 0.05, inject=1.5, target=1),
    Case("large model, 1.5x (injected)", 2, 0.5, inject=1.5, target=1),
    Case("DP-only 4 replicas, one 3x (inj.)", 4, 0.15, inject=3.0, target=3),
    Case("DP-only 4 replicas; one 3x from start", 4, 0.15, inject=3.0, target=3, slow_from=0),
    Case("no fault", 2, 0.15),
    Case("no fault (4 replicas)", 4, 0.15),
)


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _pin(pid: int, core: int) -> None:
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), {core})


def _place(pid: int, device: int, case: Case, cores: list[int], started: bool = False) -> None:
    """Pin ``device``'s worker to its core; in the noisy-neighbour cases only the target
    is pinned (from the onset, ``started``, in "neighbour-onset"), the others may run on
    every core."""
    if case.external in ("neighbour", "neighbour-onset") and (device != case.target or not (
            started or case.external == "neighbour")):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), set(cores))
        return
    _pin(pid, cores[device % len(cores)])


def _traced(rows: list[dict[str, Any]], path: Path | None) -> Any:
    """The default fail-slow detector, keeping every iteration it observes in ``rows``
    and writing it to ``path`` (JSON lines) if given: per device its compute, run delay
    in compute and CPUs; the detection when it is not "none"."""
    det = build_failslow_detector(CONFIG)
    observe = det.observe
    out = path.open("w") if path is not None else None

    def recording(iteration: int, profiles: Any) -> Any:
        d = observe(iteration, profiles)
        row: dict[str, Any] = {"it": iteration, "ranks": {
            str(p.device): [round(compute_of(p), 5), round(p.compute_wait_s, 5), len(p.cpus)]
            for p in profiles.values()}}
        if d.action != "none":
            row["action"] = d.action
            if d.verdict is not None:
                row["rule"], row["evidence"] = d.verdict.rule, d.verdict.evidence[:400]
            if d.report is not None:
                row["report"] = [list(d.report.devices), d.report.cause]
        rows.append(row)
        if out is not None:
            out.write(json.dumps(row) + "\n")
            out.flush()
        return d

    det.observe = recording  # type: ignore[method-assign]
    return det


def run_case(case: Case, timeout_s: float = 300.0, outside_per_core: int = 0,
             trace: Path | None = None, outside_pinned: bool = False) -> dict[str, Any]:
    """One run of ``case``; returns what the controller reported and when.
    ``outside_per_core``: busy processes per core running through the run, unpinned
    (the scheduler places them) or with ``outside_pinned`` that many pinned to each core
    (load the same on every core: what a neighbour adds is then its own);
    ``trace``: a file to write every observed iteration to (:func:`_traced`)."""
    cores = _cores()
    busy = (None if outside_per_core <= 0 else CpuHogs(cores, per_core=outside_per_core) if outside_pinned
            else CpuHogs(None, per_core=outside_per_core * len(cores)))
    if busy is not None:
        busy.start().release()
    try:
        return _run_case(case, timeout_s, cores, trace)
    finally:
        if busy is not None:
            busy.kill()


def _run_case(case: Case, timeout_s: float, cores: list[int], trace: Path | None = None) -> dict[str, Any]:
    alpha = case.compute_s / (12 * 1024)  # 4 micro-batches x (forward + 2 x backward) x ~N tokens
    workers = {}
    for d in range(case.replicas):
        args = ["--busy", "--alpha", f"{alpha:.3g}", "--beta", "0", "--microbatches", "4", "--comm", "0.005",
                "--seed", "0"]
        if case.inject != 1.0 and d == case.target:
            args += ["--slow-compute", str(case.inject), "--slow-from", str(case.slow_from)]
        workers[d] = args
    # The hogs are started (and held) before the job: each busy process takes seconds to
    # start on a loaded machine, and they must begin at the onset, on every core at once.
    hog_cores = ([cores[case.target % len(cores)]]  # type: ignore[operator]
                 if case.external in ("hog", "neighbour", "neighbour-onset")
                 else sorted({cores[d % len(cores)] for d in workers}) if case.external == "hog-all" else [])
    hogs = CpuHogs(hog_cores, per_core=2 if case.external == "neighbour-onset" else 3)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    onset = case.slow_from if case.slow_from > 0 else JUDGED
    loads = []
    outside = OutsideLoad()  # CPU other processes (not this benchmark's tree) took
    rows: list[dict[str, Any]] = []
    failslow = _traced(rows, trace)
    with hogs if hog_cores else contextlib.nullcontext(), SyntheticCluster(CONFIG, workers, failslow=failslow) as c:
        for d, p in c.workers.items():
            _place(p.pid, d, case, cores)  # type: ignore[attr-defined]
        c.go()
        deadline = time.monotonic() + timeout_s
        started = False
        while time.monotonic() < deadline:
            done = max((d.iteration for d in c.events.detections), default=-1)
            loads.append(os.getloadavg()[0])
            outside.sample()
            if case.external and not started and done >= ONSET - 2:
                onset, started = done + 2, True
                for d, p in c.workers.items():  # threads started since (the beat thread) too
                    _place(p.pid, d, case, cores, started=True)  # type: ignore[attr-defined]
                if hog_cores:
                    hogs.release()
                elif case.external == "duty":
                    period = duty_period(case.compute_s)
                    t = threading.Thread(target=duty_cycle, args=(c.workers[case.target].pid, stop, period),  # type: ignore[index,attr-defined]
                                         daemon=True)
                    t.start()
                    threads.append(t)
            if done >= onset + AFTER:
                break
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(5)
        hogs.kill()
        dets = c.events.detections
        reports = [d for d in dets if d.report is not None]
    hit = next((d for d in reports if case.target is not None and case.target in d.report.devices
                and d.iteration >= onset), None)
    false = [d for d in reports if case.target is None or set(d.report.devices) - {case.target}
             or d.iteration < onset]
    return {
        "onset": onset,
        "iterations": max((d.iteration for d in dets), default=-1) + 1,
        "detected": hit is not None if case.target is not None else None,
        "latency": hit.iteration - onset + 1 if hit is not None else None,
        "cause": hit.report.cause if hit is not None else None,
        "false_reports": len(false),
        "reports": [(d.iteration, list(d.report.devices), d.report.cause) for d in reports],
        "load": [min(loads, default=0.0), max(loads, default=0.0)],
        "outside_cores": round(outside.cores_used(), 3),
        "target_vs_peers": _target_vs_peers(rows, case.target if case.target is not None else 0, onset),
    }


def _target_vs_peers(rows: list[dict[str, Any]], target: int, onset: int) -> float | None:
    """How much slower the target computed than its peers from the onset on (the onset
    included) relative to before it: the median over iterations of its compute over the
    median of the others' in the same iteration, over the same before the onset. What the
    slowdown made of the target under the outside load (the scheduler may move the
    outside load off a hogged core onto its peers'), or for a no-fault case how uneven
    the load fell on device 0."""
    def paired(r: dict[str, Any]) -> float | None:
        ranks = {int(d): v[0] for d, v in r["ranks"].items()}
        others = [c for d, c in ranks.items() if d != target and c > 0]
        if target not in ranks or not others:
            return None
        return ranks[target] / statistics.median(others)

    before = [x for r in rows if 3 <= r["it"] < onset - 1 and (x := paired(r)) is not None]
    after = [x for r in rows if r["it"] >= onset and (x := paired(r)) is not None]
    if not before or not after:
        return None
    return round(statistics.median(after) / statistics.median(before), 3)


def _precision_recall(cases: dict[str, Any]) -> dict[str, Any]:
    """Over every run of ``cases``: reports naming the slowed device (after its onset)
    over all reports, and slowdowns reported over slowdowns made."""
    true = made = found = reports = made13 = found13 = 0
    for v in cases.values():
        for r in v["details"]:
            hit = 1 if r["detected"] else 0
            reports += hit + r["false_reports"]
            true += hit
            if r["detected"] is not None:
                made += 1
                found += hit
                if (r.get("target_vs_peers") or 0.0) >= 1.3:
                    made13 += 1
                    found13 += hit
    return {"precision": true / reports if reports else None, "recall": found / made if made else None,
            "reports": reports, "slowdowns": made,
            # Only the runs whose target computed >= 1.3x its peers after the onset: the
            # issue's target ("a rank slowed >= 1.3x by contention its peers do not share").
            "recall_1_3x": found13 / made13 if made13 else None, "slowdowns_1_3x": made13}


def run(quick: bool, runs: int | None = None, outside: tuple[int, ...] = (0,),
        only: tuple[str, ...] = (), trace: Path | None = None, outside_pinned: bool = False) -> dict[str, Any]:
    n = runs or (1 if quick else 3)
    out: dict[str, Any] = {"runs": n, "cases": {}, "outside_load": list(outside), "by_load": {},
                           "outside_pinned": outside_pinned}
    t0 = time.perf_counter()
    for k in outside:
        level: dict[str, Any] = {}
        for case in CASES:
            if only and not any(o in case.name for o in only):
                continue
            name = case.name if outside == (0,) else f"{case.name} @ {k}x"
            files = [None if trace is None else trace / f"{_slug(case.name)}-{k}x-{i}.jsonl" for i in range(n)]
            level[name] = _case_summary(case, [run_case(case, outside_per_core=k, trace=f,
                                                        outside_pinned=outside_pinned) for f in files], n)
            level[name]["outside_per_core"] = k
        out["cases"].update(level)
        out["by_load"][str(k)] = _precision_recall(level)
    out.update(_precision_recall(out["cases"]))
    out["wall_s"] = time.perf_counter() - t0
    return out


def _case_summary(case: Case, rs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    lats = [r["latency"] for r in rs if r["latency"] is not None]
    return {
        "runs": n,
        "expect": "report" if case.target is not None else "nothing",
        "misses": sum(1 for r in rs if r["detected"] is False),
        "false_reports": sum(r["false_reports"] for r in rs),
        "latency_max": max(lats) if lats else None,
        "latency_mean": statistics.fmean(lats) if lats else None,
        "causes": sorted({r["cause"] for r in rs if r["cause"]}),
        "load": [min(r["load"][0] for r in rs), max(r["load"][1] for r in rs)],
        "outside_cores": max(r["outside_cores"] for r in rs),
        "target_vs_peers": [r["target_vs_peers"] for r in rs],
        "details": rs,
    }


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


def _span(load: list[float]) -> str:
    return f"{load[0]:.1f}-{load[1]:.1f}"


def table(r: dict[str, Any]) -> str:
    lines = [f"externally made slowdowns (real busy workers pinned to cores, {r['runs']} run(s) per case, "
             f"onset at iteration {ONSET}, watched {AFTER} after):",
             f"  {'case':<38} {'expect':<8} {'misses':>6} {'false reports':>13} {'latency max':>11}  cause         "
             "load avg   outside  target/peers"]
    for name, v in r["cases"].items():
        lat = "-" if v["latency_max"] is None else f"{v['latency_max']} it"
        tvp = ",".join("-" if x is None else f"{x:.2f}" for x in v.get("target_vs_peers", []))
        lines.append(f"  {name:<38} {v['expect']:<8} {v['misses']:>6} {v['false_reports']:>13} {lat:>11}  "
                     f"{','.join(v['causes']) or '-':<13} {_span(v['load']):<10} {v.get('outside_cores', 0.0):.2f}     "
                     f"{tvp}")
    lines.append("  (outside: cores' time other processes than this benchmark's took, worst run; "
                 f"{len(_cores())} cores; '@ kx': k {'pinned' if r.get('outside_pinned') else 'unpinned'} busy "
                 "processes per core added through the run; "
                 "target/peers: per run, the target's compute over its peers' after the onset relative to before)")
    for k, pr in r.get("by_load", {}).items():
        lines.append(f"  outside load {k}x the cores: precision {_pct(pr['precision'])} over {pr['reports']} reports, "
                     f"recall {_pct(pr['recall'])} over {pr['slowdowns']} slowdowns, "
                     f"{_pct(pr.get('recall_1_3x'))} over the {pr.get('slowdowns_1_3x', 0)} with the target >= 1.3x "
                     "its peers")
    if "precision" in r:
        lines.append(f"  all runs: precision {_pct(r['precision'])}, recall {_pct(r['recall'])}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def parse_loads(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> (0, 1, 2): busy processes per core; refuses anything else by name."""
    try:
        loads = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--outside-load takes integers per core like 0,1,2, got {text!r}") from None
    if not loads or min(loads) < 0:
        raise argparse.ArgumentTypeError(f"--outside-load takes integers >= 0, got {text!r}")
    return loads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--outside-load", type=parse_loads, default=(0,),
                    help="busy processes per core added through each run, e.g. 0,1,2 (default 0)")
    ap.add_argument("--outside-pinned", action="store_true",
                    help="pin the outside load evenly, that many busy processes to each core (default: unpinned)")
    ap.add_argument("--cases", default="", help="comma-separated parts of case names to run (default: all)")
    ap.add_argument("--trace", type=Path, help="folder for one JSON-lines trace per run (per-device compute, "
                    "run delay, detections)")
    a = ap.parse_args(argv)
    if a.trace is not None:
        a.trace.mkdir(parents=True, exist_ok=True)
    r = run(a.quick, a.runs, a.outside_load, tuple(x for x in a.cases.split(",") if x), a.trace, a.outside_pinned)
    print(table(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=2, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
