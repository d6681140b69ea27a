"""Sweeps and reports: throughput with confidence intervals, ratios, idle-GPU-time
amplification, throughput-over-time plots, JSON.

Throughput is samples (packed micro-batches of the job's token budget) per second of
job time, averaged over the whole trace; its 95 % confidence interval is Student's t
over seeds (each seed is an independent trace). *Retained* is the fraction of the
fault-free throughput. Ratios compare policies seed by seed on the same traces.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from resihp_core.sim.cluster import Costs, JobSpec, SimError
from resihp_core.sim.engine import Health, RunResult, run
from resihp_core.sim.trace import SEVERITY_LOSS, Trace, generate

__all__ = ["Progress", "amplification", "ci95", "plot", "policy", "summarise", "sweep"]

# Two-sided 95 % Student t quantiles by degrees of freedom (1..30; normal beyond).
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def ci95(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % confidence interval); half-width 0 for one value."""
    vals = [float(v) for v in values]
    if not vals:
        raise SimError("ci95 needs at least one value")
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return mean, 0.0
    t = _T95[len(vals) - 2] if len(vals) - 1 <= len(_T95) else 1.96
    return mean, t * statistics.stdev(vals) / math.sqrt(len(vals))


def policy(name: str, **options: Any) -> Any:
    """A fresh policy registered as ``name`` (``resihp_register_sim_policies``)."""
    from resihp_core.plugins import get_plugins

    return get_plugins().sim_policies().create(name, **options)


def policy_names() -> list[str]:
    from resihp_core.plugins import get_plugins
    from resihp_core.sim.builtin import POLICY_CLASSES

    names = get_plugins().sim_policies().names()
    order = list(POLICY_CLASSES)
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


class Progress:
    """A one-line progress bar on stderr for long sweeps (silent when disabled)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total, self.done, self.enabled, self.width = max(1, total), 0, enabled, width
        self.t0 = time.perf_counter()

    def step(self, label: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        bar = "#" * int(frac * self.width)
        el = time.perf_counter() - self.t0
        eta = el / frac - el if frac > 0 else 0.0
        sys.stderr.write(f"\r[{bar:<{self.width}}] {self.done}/{self.total} {el:5.0f}s eta {eta:4.0f}s {label[:40]:<40}")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def sweep(job: JobSpec, scenarios: Iterable[str | Trace], policies: Sequence[str], *, seeds: int = 3,
          hours: float = 12.0, costs: Costs | None = None, progress: bool = False,
          trace_dir: str | Path | None = None) -> dict[str, Any]:
    """Run every policy on ``seeds`` traces of every scenario; returns
    ``{"job", "costs", "results": {scenario: {policy: [RunResult, ...]}}, "traces"}``.

    A scenario may be a :class:`Trace` (replayed as is, one "seed"). With
    ``trace_dir`` every generated trace is written there."""
    costs = costs or Costs()
    state0 = job.state()
    scen = list(scenarios)
    total = sum(1 if isinstance(s, Trace) else seeds for s in scen) * len(policies)
    bar = Progress(total, progress)
    results: dict[str, dict[str, list[RunResult]]] = {}
    traces: dict[str, list[Trace]] = {}
    cal: dict[tuple[str, str], float] = {}
    for s in scen:
        if isinstance(s, Trace):
            if s.job != job:
                raise SimError(f"trace {s.scenario!r} is for job {s.job}, the sweep runs {job}")
            trs = [s]
        else:
            trs = [generate(s, job, seed=k, hours=hours, state=state0, calibration=cal) for k in range(seeds)]
            for tr in trs:
                for key, v in tr.meta.get("calibration", {}).items():
                    c, sev = key.split("/")
                    cal[(c, sev)] = v
        name = trs[0].scenario or "trace"
        traces[name] = trs
        if trace_dir is not None:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            for tr in trs:
                tr.save(Path(trace_dir) / f"{job.devices}-{name}-seed{tr.seed}.json")
        for pol in policies:
            for tr in trs:
                results.setdefault(name, {}).setdefault(pol, []).append(
                    run(tr, policy(pol), costs=costs, state0=state0))
                bar.step(f"{job.devices} {name} {pol} seed {tr.seed}")
    return {"job": job, "costs": costs, "results": results, "traces": traces}


def summarise(out: dict[str, Any], reference: str = "resihp") -> dict[str, Any]:
    """Per scenario and policy: throughput mean and 95 % CI, retained fraction (mean and
    CI), and the ratio of ``reference``'s throughput to the policy's (mean over seeds,
    with CI). JSON-ready."""
    rows: dict[str, Any] = {}
    for scen, by_pol in out["results"].items():
        row: dict[str, Any] = {}
        ref = by_pol.get(reference)
        for pol, runs in by_pol.items():
            thr, hw = ci95([r.throughput for r in runs])
            ret, rhw = ci95([r.retained for r in runs])
            d = {"throughput": thr, "throughput_ci95": hw, "retained": ret, "retained_ci95": rhw,
                 "healthy_throughput": runs[0].healthy_throughput, "seeds": len(runs),
                 "wall_s": sum(r.wall_s for r in runs)}
            if ref is not None and pol != reference:
                ratios = [a.throughput / b.throughput if b.throughput > 0 else math.inf
                          for a, b in zip(ref, runs)]
                finite = [x for x in ratios if math.isfinite(x)]
                if finite:
                    d[f"{reference}_over"], d[f"{reference}_over_ci95"] = ci95(finite)
            row[pol] = d
        rows[scen] = row
    return rows


def table(summary: dict[str, Any], policies: Sequence[str], *, title: str = "") -> str:
    """Retained fraction of fault-free throughput ± 95 % CI, one row per scenario."""
    head = f"{'scenario':<12}" + "".join(f"{p:>15}" for p in policies)
    lines = ([title] if title else []) + [head]
    for scen, row in summary.items():
        cells = []
        for p in policies:
            d = row.get(p)
            cells.append("-" if d is None else f"{d['retained']:.3f}±{d['retained_ci95']:.3f}")
        lines.append(f"{scen:<12}" + "".join(f"{c:>15}" for c in cells))
    return "\n".join(lines)


# ------------------------------------------------------------ amplification
def _idle(plan: Any, ctx_eval: Any, health: Health, devices: Iterable[int]) -> dict[str, Any]:
    """Idle GPU-seconds of one iteration per device: iteration time minus the useful
    compute the device did (a TP group computes at its slowest member's speed, so a
    faster member is useful only for that fraction of the group's busy time)."""
    res = ctx_eval.simulate(plan)
    T = res.iteration_time
    sp = health.speed_map()
    useful: dict[int, float] = {}
    for i, (r, s) in enumerate(res.executors):
        g = plan.group(r, s)
        pg = min(sp.get(d, 1.0) for d in g)
        for d in g:
            useful[d] = float(res.busy[i]) * pg / sp.get(d, 1.0)
    return {"T": T, "idle": {d: T - useful.get(d, 0.0) for d in devices}}


def amplification(job: JobSpec, *, severity: str = "medium", cause: str = "compute") -> dict[str, Any]:
    """Idle GPU time that one slowed device causes across the job, split by where it
    lands: its TP group, the other stages of its replica (PP), the other replicas (DP),
    and devices taken out of the plan; without mitigation and with ResiHP's plan.
    ``amplification`` is the extra idle GPU-seconds per iteration over the slowed
    device's own extra compute seconds (unmitigated)."""
    from resihp_core.protocol import FailureReport
    from resihp_core.scheduler import Planner
    from resihp_core.scheduler.evaluate import Evaluator
    from resihp_core.sim.trace import severity_throughput

    st = job.state()
    plan = st.plan
    r0, s0 = 0, plan.pp // 2
    dev = plan.group(r0, s0)[min(1, job.tp - 1)]
    p = severity_throughput(job, dev, cause, SEVERITY_LOSS[severity], st)
    health = Health(speeds=((dev, p),)) if cause == "compute" else Health(links=((dev, p),))
    devices = sorted(st.topology.ids)
    ev0 = Evaluator(st.predictor, st.features)
    evs = Evaluator(st.predictor, st.features, health.speed_map(), health.link_map())
    base = _idle(plan, ev0, Health(), devices)
    slow = _idle(plan, evs, health, devices)
    res_h, res_s = ev0.simulate(plan), evs.simulate(plan)
    i0 = res_h.executors.index((r0, s0))
    own = float(res_s.busy[i0] - res_h.busy[i0]) if cause == "compute" else float(
        res_s.iteration_time - res_h.iteration_time)
    report = FailureReport(generation=0, failure="fail-slow", devices=(dev,), cause=cause, throughput={dev: p})
    decision = Planner().plan(st, report)
    mit = _idle(decision.plan, evs, health, devices)

    def split(idle: dict[int, float], the_plan: Any) -> dict[str, float]:
        out = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "out_of_plan": 0.0, "self": 0.0}
        for d in devices:
            extra = idle[d] - base["idle"][d]
            loc = plan.location(d)
            if d == dev:
                out["self"] += extra
            elif the_plan.location(d) is None:
                out["out_of_plan"] += extra
            elif loc is not None and loc[:2] == (r0, s0):
                out["tp"] += extra
            elif loc is not None and loc[0] == r0:
                out["pp"] += extra
            else:
                out["dp"] += extra
        out["total"] = sum(v for k, v in out.items() if k != "self") + out["self"]
        return out

    un, wm = split(slow["idle"], plan), split(mit["idle"], decision.plan)
    return {
        "job": job.to_dict(), "device": dev, "cause": cause, "severity": severity, "throughput": p,
        "healthy_iteration_s": base["T"], "slow_iteration_s": slow["T"], "mitigated_iteration_s": mit["T"],
        "own_extra_s": own,
        "unmitigated": un, "mitigated": wm,
        "amplification": un["total"] / own if own > 0 else None,
        "amplification_mitigated": wm["total"] / own if own > 0 else None,
        "plan": decision.reason,
    }


# ------------------------------------------------------------------ plots
def plot(runs: Sequence[RunResult], trace: Trace, path: str | Path, *, title: str = "") -> Path:
    """Throughput over time of each run (same trace), failures marked: red lines for
    fail-stops, orange for fail-slows, thin grey for repairs and recoveries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for r in runs:
        xs, ys = [], []
        for s in r.segments:
            xs += [s.start / 3600, s.end / 3600]
            ys += [s.throughput, s.throughput]
        ax.plot(xs, ys, label=f"{r.policy} ({r.retained:.2f})", lw=1.2)
    colours = {"stop": "red", "slow": "orange", "repair": "0.6", "recover": "0.6"}
    for e in trace.events:
        ax.axvline(e.time / 3600, color=colours[e.kind], lw=0.6 if e.kind in ("repair", "recover") else 1.0,
                   ls="--" if e.kind in ("repair", "recover") else "-", alpha=0.7)
    if runs:
        ax.axhline(runs[0].healthy_throughput, color="k", lw=0.5, ls=":", label="fault-free")
    ax.set_xlabel("job time (h); red: fail-stop, orange: fail-slow, grey dashed: repair/recovery")
    ax.set_ylabel("samples/s")
    ax.set_title(title or f"{trace.scenario}, seed {trace.seed}, {trace.job.devices} devices")
    ax.legend(fontsize=7, ncol=4, loc="lower left")
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
