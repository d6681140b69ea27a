"""False reports and misses of the fail-slow detector on this (loaded) machine, per case,
over many runs (docs/detector.md "False reports on a loaded machine").

No-fault cases — nothing is slowed, every fail-slow report is false:

* **cpu-burst** — test_environment's job (reference backend, TP1 x PP2 x DP2, real
  training workers, supervisor): ``cores + 1`` busy processes that belong to no job,
  not pinned, from iteration 8 for 16 iterations;
* **steady-load** — the same job with two unpinned busy processes for the whole run
  (a loaded machine, no fault);
* **no-load** — the same job with nothing added (whatever else runs on the machine);
* **seq-fluctuation** — three synthetic workers whose documents' lengths vary (lognormal
  corpus, quadratic attention term), no fault.

Fault cases — ``benchmarks/detector_external.py``'s (pinned CPU hog of one worker,
duty-cycled SIGSTOP, 1.5x of a small model, DP-only one replica 3x) and its no-fault
whole-machine load pinned on every core.

Every run records the profiles the detector saw (``--traces DIR``: one JSON file per
run) so a false report can be replayed offline (:func:`replay`) and turned into a unit
test. Prints per case: runs, runs with a false report, false reports, misses, latency,
load average.

    python benchmarks/false_reports.py [--quick] [--runs N] [--cases a,b] [--json PATH] [--traces DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import msgspec  # noqa: E402

import resihp_core.detector.failslow as failslow  # noqa: E402
from resihp_core.protocol import IterationProfile  # noqa: E402

BUSY = "import os, time\nend = time.time() + 300\nwhile time.time() < end and os.getppid() != 1: pass\n"


class _Recorder:
    """Wraps a fail-slow detector: records every iteration's profiles (and each new
    generation) and delegates everything else."""

    def __init__(self, inner: Any, log: list[dict[str, Any]]) -> None:
        self._inner, self._log = inner, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def observe(self, iteration: int, profiles: Any) -> Any:
        det = self._inner.observe(iteration, profiles)
        self._log.append({"iteration": iteration, "generation": getattr(self._inner, "generation", 0),
                          "profiles": [msgspec.to_builtins(p) for p in profiles.values()],
                          "action": det.action,
                          "report": None if det.report is None else [list(det.report.devices), det.report.cause],
                          "evidence": det.verdict.evidence[:600] if det.verdict is not None else "",
                          "rule": det.verdict.rule if det.verdict is not None else ""})
        return det

    def reset(self, generation: int, **kw: Any) -> None:
        self._log.append({"reset": generation, "speeds": dict(kw.get("speeds") or {})})
        self._inner.reset(generation, **kw)

    def note_environment(self, iteration: int, contention: Any) -> None:
        self._log.append({"env": iteration, "contention": {str(d): float(v) for d, v in contention.items()}})
        self._inner.note_environment(iteration, contention)


class recording:
    """Context: every fail-slow detector built meanwhile records into ``self.log``."""

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []
        self._orig: Callable[..., Any] = failslow.build_failslow_detector

    def __enter__(self) -> recording:
        orig, log = self._orig, self.log
        failslow.build_failslow_detector = lambda *a, **kw: _Recorder(orig(*a, **kw), log)  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        failslow.build_failslow_detector = self._orig  # type: ignore[assignment]


def profiles_of(entry: dict[str, Any]) -> dict[int, IterationProfile]:
    """A recorded iteration's profiles, as the detector got them."""
    ps = [msgspec.convert(p, IterationProfile) for p in entry["profiles"]]
    return {p.rank: p for p in ps}


def _detector_for(case: str, plan_text: str | None) -> Any:
    """A fresh detector built as the case's run built it."""
    if plan_text is not None:  # run_resilient's: the job's plan and the planner's predictor
        from resihp_core.detector.model import WorkloadModel
        from resihp_core.plan import Topology, parse_plan
        from tests.integration.test_chaos import SLOW_DETECTOR, _planner_state

        plan = parse_plan(plan_text)
        state, _ = _planner_state(plan, Topology.uniform(2, len(plan.devices()) // 2))
        model = WorkloadModel(plan=plan, predictor=state.predictor, warmup_iterations=SLOW_DETECTOR.warmup_iterations)
        return failslow.build_failslow_detector(SLOW_DETECTOR, model=model, plan=plan)
    if case == "seq-fluctuation":
        from resihp_core.config import DetectorConfig

        return failslow.build_failslow_detector(DetectorConfig())
    import detector_external as de

    return failslow.build_failslow_detector(de.CONFIG)


AFFINITY = ("recorded", "as-run", "pinned")


def with_affinity(profiles: dict[int, IterationProfile], case: str, mode: str, cores: int = 2
                  ) -> dict[int, IterationProfile]:
    """Profiles recorded before workers reported their CPUs (``IterationProfile.cpus``)
    with the CPUs filled in: ``recorded`` leaves them out (not reported: the detector
    takes them as shared with the peers); ``as-run`` gives each worker the CPUs it had
    in that run (detector_external.py pins worker d to core d mod ``cores``; the
    training and sequence cases pin nothing: every core); ``pinned`` gives every device
    a core of its own (what the detector assumed before it read the CPUs: replaying
    with it must reproduce the code before the change). Profiles that carry CPUs are
    left as they are."""
    if mode == "recorded":
        return profiles
    out = {}
    for r, p in profiles.items():
        if not p.cpus:
            if mode == "pinned":
                cpus: tuple[int, ...] = (p.device,)
            elif case in _EXTERNAL:
                cpus = (p.device % cores,)
            else:
                cpus = tuple(range(cores))
            p = msgspec.structs.replace(p, cpus=cpus)
        out[r] = p
    return out


def replay(run: dict[str, Any], case: str, affinity: str = "recorded") -> list[tuple[int, list[int], str, str]]:
    """Feed a recorded run's first generation to a fresh detector (the code as it is
    now); returns its fail-slow reports as (iteration, devices, cause, evidence).
    ``affinity``: how profiles without CPUs are filled (:func:`with_affinity`)."""
    det = _detector_for(case, run.get("plan"))
    out = []
    for e in run.get("trace", []):
        if "reset" in e:
            if e["reset"] > 0:
                break  # a new plan: the recorded run acted on a report; stop here
            continue
        if "env" in e:  # each node's CPU contention, as the controller handed it over
            det.note_environment(e["env"], {int(d): v for d, v in e["contention"].items()})
            continue
        d = det.observe(e["iteration"], with_affinity(profiles_of(e), case, affinity))
        if d.report is not None:
            out.append((e["iteration"], list(d.report.devices), d.report.cause,
                        f"[{d.verdict.rule}] {d.verdict.evidence[:400]}"))
    return out


def replay_dir(folder: Path, affinity: str = "recorded") -> dict[str, dict[str, Any]]:
    """Replay every trace in ``folder``; per case: runs, runs with a false report, misses."""
    res: dict[str, dict[str, Any]] = {}
    for f in sorted(folder.glob("*.json")):
        case = f.stem.rsplit("-", 1)[0]
        run = json.loads(f.read_text())
        if not run.get("trace"):
            continue
        reps = replay(run, case, affinity)
        v = res.setdefault(case, {"runs": 0, "runs_with_false": 0, "false_reports": 0, "misses": 0, "latency": [],
                                  "false": []})
        v["runs"] += 1
        target = None
        onset = run.get("onset", 0)
        if CASES[case][0] == "report":
            import detector_external as de

            target = next(c for c in de.CASES if c.name.startswith(_EXTERNAL[case])).target
        false = [r for r in reps if target is None or set(r[1]) - {target} or r[0] < onset]
        hit = next((r for r in reps if target is not None and target in r[1] and r[0] >= onset), None)
        v["runs_with_false"] += bool(false)
        v["false_reports"] += len(false)
        v["false"] += [(f.stem, *r) for r in false]
        if target is not None:
            if hit is None:
                v["misses"] += 1
            else:
                v["latency"].append(hit[0] - onset + 1)
    return res


# ------------------------------------------------------------------ cases
def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]


def run_training(load: str, iterations: int = 30) -> dict[str, Any]:
    """test_environment's job with ``load`` ("burst", "steady" or "none") added."""
    from tests.integration.backend_harness import uniform
    from tests.integration.test_chaos import SLOW_DETECTOR, _chaos

    burst_from, burst_its = 8, 16
    n = max(2, os.cpu_count() or 2) + 1
    plan = uniform(1, 2, 2, 3)
    procs: list[subprocess.Popen] = []
    loads: list[float] = []

    def on_iteration(rec: Any) -> None:
        loads.append(os.getloadavg()[0])
        if load == "burst":
            if rec.iteration + 1 == burst_from and not procs:
                procs.extend(_busy(n))
            if rec.iteration + 1 == burst_from + burst_its:
                for p in procs:
                    p.kill()

    if load == "steady":
        procs.extend(_busy(2))
    with recording() as rec:
        try:
            run = _chaos(plan, [], iterations=iterations, detector=SLOW_DETECTOR, on_iteration=on_iteration)
        finally:
            for p in procs:
                p.kill()
                p.wait(10)
    reports = [e for e in run.events if e["kind"] == "failure" and e["failure"] == "fail-slow"]
    # The reference backend compares its replicas' state fingerprints at every commit
    # (docs/sdc.md): with no fault, any silent-data-corruption finding is false too.
    sdc = [e for e in run.events if e["kind"] == "sdc"]
    return {"false_reports": len(reports) + len(sdc), "detected": None, "latency": None,
            "reports": [(e["devices"], e["cause"]) for e in reports] + [(e["suspects"] + e["candidates"], "sdc")
                                                                       for e in sdc],
            "sdc_reports": len(sdc),
            "load": [min(loads, default=0.0), max(loads, default=0.0)], "trace": rec.log,
            "plan": plan.to_text()}


def run_fluctuation(seconds: float = 6.0) -> dict[str, Any]:
    """Three synthetic workers, documents of varying length, no fault."""
    from resihp_core.config import DetectorConfig
    from resihp_core.testing.synthetic import SyntheticCluster

    work = ["--alpha", "1e-5", "--beta", "4e-9", "--microbatches", "4"]
    loads = []
    with recording() as rec, SyntheticCluster(DetectorConfig(), {0: work, 1: work, 2: work}) as c:
        c.go()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            loads.append(os.getloadavg()[0])
            time.sleep(0.25)
        reports = [r for r in c.events.reports if r.failure == "fail-slow"]  # type: ignore[attr-defined]
    return {"false_reports": len(reports), "detected": None, "latency": None,
            "reports": [(list(r.devices), r.cause) for r in reports],
            "load": [min(loads, default=0.0), max(loads, default=0.0)], "trace": rec.log}


def run_external(name: str) -> dict[str, Any]:
    import detector_external as de

    case = next(c for c in de.CASES if c.name.startswith(name))
    with recording() as rec:
        r = de.run_case(case)
    r["trace"] = rec.log
    return r


_EXTERNAL = {"hog-all": "whole-machine", "pinned-hog": "pinned CPU hog", "duty-stop": "duty-cycled",
             "small-1.5x": "small model", "dp-only-3x": "DP-only"}
CASES: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "cpu-burst": ("nothing", lambda: run_training("burst")),
    "steady-load": ("nothing", lambda: run_training("steady")),
    "no-load": ("nothing", lambda: run_training("none")),
    "seq-fluctuation": ("nothing", run_fluctuation),
    "hog-all": ("nothing", lambda: run_external("whole-machine")),
    "pinned-hog": ("report", lambda: run_external("pinned CPU hog")),
    "duty-stop": ("report", lambda: run_external("duty-cycled")),
    "small-1.5x": ("report", lambda: run_external("small model")),
    "dp-only-3x": ("report", lambda: run_external("DP-only")),
}
QUICK = ("cpu-burst", "seq-fluctuation", "pinned-hog", "duty-stop")


def run(cases: list[str], runs: int, traces: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs, "cases": {}, "cores": len(os.sched_getaffinity(0))}
    t0 = time.perf_counter()
    for name in cases:
        expect, fn = CASES[name]
        rs = []
        for i in range(runs):
            t = time.perf_counter()
            try:
                r = fn()
            except Exception as e:  # noqa: BLE001 - a failed run is counted, not fatal
                r = {"error": repr(e)[:500], "false_reports": 0, "detected": None, "latency": None,
                     "load": [0.0, 0.0], "trace": []}
            r["wall_s"] = time.perf_counter() - t
            if traces is not None:
                traces.mkdir(parents=True, exist_ok=True)
                (traces / f"{name}-{i}.json").write_text(json.dumps(r, default=str))
            r.pop("trace", None)
            rs.append(r)
            print(f"  {name} run {i}: false {r['false_reports']} detected {r.get('detected')} "
                  f"latency {r.get('latency')} reports {r.get('reports')} load {r['load'][0]:.1f}-{r['load'][1]:.1f}"
                  + (f" ERROR {r['error']}" if "error" in r else ""), flush=True)
        lats = [r["latency"] for r in rs if r.get("latency") is not None]
        ok = [r for r in rs if "error" not in r]
        out["cases"][name] = {
            "expect": expect, "runs": len(ok), "errors": len(rs) - len(ok),
            "runs_with_false": sum(1 for r in ok if r["false_reports"]),
            "false_reports": sum(r["false_reports"] for r in ok),
            "misses": sum(1 for r in ok if r.get("detected") is False),
            "latency_max": max(lats) if lats else None,
            "latency_median": statistics.median(lats) if lats else None,
            "load": [min((r["load"][0] for r in ok), default=0.0), max((r["load"][1] for r in ok), default=0.0)],
            "details": rs,
        }
    out["wall_s"] = time.perf_counter() - t0
    return out


def table(r: dict[str, Any]) -> str:
    lines = [f"fail-slow false reports and misses ({r['cores']} cores; runs per case as listed):",
             f"  {'case':<16} {'expect':<8} {'runs':>4} {'runs w/ false':>13} {'false':>5} {'misses':>6} "
             f"{'latency med/max':>15}  load avg"]
    for name, v in r["cases"].items():
        lat = "-" if v["latency_max"] is None else f"{v['latency_median']:g}/{v['latency_max']} it"
        lines.append(f"  {name:<16} {v['expect']:<8} {v['runs']:>4} {v['runs_with_false']:>13} {v['false_reports']:>5} "
                     f"{v['misses']:>6} {lat:>15}  {v['load'][0]:.1f}-{v['load'][1]:.1f}"
                     + (f"  ({v['errors']} failed runs)" if v["errors"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"cases {','.join(QUICK)}, 2 runs each")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--cases", help=f"comma-separated, of {','.join(CASES)}")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--traces", type=Path, help="write each run's recorded profiles here")
    ap.add_argument("--replay", type=Path, nargs="+",
                    help="replay the traces in these folders with the code as it is now")
    ap.add_argument("--affinity", choices=AFFINITY, default="recorded",
                    help="replay: CPUs of profiles recorded without them (see with_affinity)")
    a = ap.parse_args(argv)
    if a.replay:
        res: dict[str, dict[str, Any]] = {}
        for folder in a.replay:
            for name, v in replay_dir(folder, a.affinity).items():
                acc = res.setdefault(name, {k: (0 if isinstance(x, int) else []) for k, x in v.items()})
                for k, x in v.items():
                    acc[k] += x
        print(f"replayed {' '.join(map(str, a.replay))} with the detector as it is now (affinity {a.affinity}):")
        print(f"  {'case':<16} {'runs':>4} {'runs w/ false':>13} {'false':>5} {'misses':>6}  latency")
        for name, v in res.items():
            print(f"  {name:<16} {v['runs']:>4} {v['runs_with_false']:>13} {v['false_reports']:>5} {v['misses']:>6}  "
                  f"{sorted(v['latency'])}")
        for name, v in res.items():
            for fr in v["false"]:
                print("  false:", fr)
        if a.json:
            a.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
        return 0
    cases = a.cases.split(",") if a.cases else list(QUICK if a.quick else CASES)
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}")
    runs = a.runs or (2 if a.quick else 5)
    r = run(cases, runs, a.traces)
    print(table(r))
    print(f"wall {r['wall_s']:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
