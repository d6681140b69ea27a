"""Failure traces: seeded, written as files, replayed exactly.

A :class:`Trace` is a time-ordered list of :class:`FailureEvent` s over a job's
devices: fail-stop (``stop``) with the matching ``repair`` after the repair time,
and fail-slow (``slow``, compute or communication, with the throughput p left) with
the matching ``recover`` after its duration. Every event carries its absolute time in
seconds of job time, so a trace file (JSON, :meth:`Trace.save` / :meth:`Trace.load`)
replays exactly whatever generated it.

:func:`generate` draws a trace for a named scenario (:data:`SCENARIOS`) from a seed:
fail-stop arrivals are a Poisson process at the scenario's mean time between failures
(of the whole job); fail-slow episodes start at exponential gaps, hit a uniformly
chosen device, and last an exponential duration. Severities weak / medium / strong are
defined (SPEC §7) by the unmitigated throughput loss they cause, 35 / 55 / 70 %; the
device throughput that causes that loss on this job is found by bisection with the
planner's own evaluator (:func:`severity_throughput`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from resihp_core.sim.cluster import JobSpec, SimError

__all__ = ["FailureEvent", "SCENARIOS", "Scenario", "Trace", "generate", "severity_throughput", "SEVERITY_LOSS"]

EventKind = Literal["stop", "repair", "slow", "recover"]
#: Unmitigated throughput loss of each fail-slow severity (SPEC §7).
SEVERITY_LOSS = {"weak": 0.35, "medium": 0.55, "strong": 0.70}


@dataclass(frozen=True)
class FailureEvent:
    """One change of the cluster's truth at ``time`` seconds of job time.

    ``cause`` (slow only) is ``"compute"`` or ``"communication"``; ``throughput`` (slow
    only) is the normalised compute speed p, or the fraction of link bandwidth left."""

    time: float
    kind: EventKind
    device: int
    cause: str = ""
    throughput: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.time, (int, float)) and math.isfinite(self.time) and self.time >= 0):
            raise SimError(f"event time must be a finite number >= 0, got {self.time!r}")
        if self.kind not in ("stop", "repair", "slow", "recover"):
            raise SimError(f"event kind must be stop/repair/slow/recover, got {self.kind!r}")
        if not isinstance(self.device, int) or self.device < 0:
            raise SimError(f"event device must be an int >= 0, got {self.device!r}")
        if self.kind == "slow":
            if self.cause not in ("compute", "communication"):
                raise SimError(f"slow event on device {self.device}: cause must be compute or "
                               f"communication, got {self.cause!r}")
            if not 0.0 < self.throughput < 1.0:
                raise SimError(f"slow event on device {self.device}: throughput must be in (0, 1), "
                               f"got {self.throughput!r}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"time": self.time, "kind": self.kind, "device": self.device}
        if self.kind in ("slow", "recover"):
            d["cause"] = self.cause
        if self.kind == "slow":
            d["throughput"] = self.throughput
        return d


@dataclass(frozen=True)
class Scenario:
    """How a trace is drawn. ``mtbf_s``: mean time between fail-stops of the job (0 =
    none); ``repair_s``: time until a stopped device rejoins; ``slow_every_s``: mean gap
    between fail-slow episodes (0 = none); ``slow_for_s``: their mean duration;
    ``severity``: weak/medium/strong or "mixed" (drawn per episode); ``causes``: the
    fail-slow causes drawn from."""

    name: str
    mtbf_s: float = 0.0
    repair_s: float = 3600.0
    slow_every_s: float = 0.0
    slow_for_s: float = 1800.0
    severity: str = "medium"
    causes: tuple[str, ...] = ("compute", "communication")


#: The scenarios of the benchmark table (SPEC §7): fail-stop at three MTBFs, fail-slow
#: at three severities, and mixed.
SCENARIOS: dict[str, Scenario] = {
    "stop-2h": Scenario("stop-2h", mtbf_s=7200.0),
    "stop-1h": Scenario("stop-1h", mtbf_s=3600.0),
    "stop-30m": Scenario("stop-30m", mtbf_s=1800.0),
    "slow-weak": Scenario("slow-weak", slow_every_s=3600.0, severity="weak"),
    "slow-medium": Scenario("slow-medium", slow_every_s=3600.0, severity="medium"),
    "slow-strong": Scenario("slow-strong", slow_every_s=3600.0, severity="strong"),
    "mixed": Scenario("mixed", mtbf_s=3600.0, slow_every_s=3600.0, severity="mixed"),
    "none": Scenario("none"),
}


@dataclass(frozen=True)
class Trace:
    """A job, a duration and the events that happen to it (time-ordered)."""

    job: JobSpec
    duration_s: float
    events: tuple[FailureEvent, ...] = ()
    scenario: str = ""
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise SimError(f"trace duration_s must be > 0, got {self.duration_s!r}")
        object.__setattr__(self, "events", tuple(sorted(self.events, key=lambda e: e.time)))
        n = self.job.devices
        for i, e in enumerate(self.events):
            if e.device >= n:
                raise SimError(f"trace event {i} names device {e.device}; the job has {n} devices")

    def to_dict(self) -> dict[str, Any]:
        return {"format": "resihp-trace v1", "scenario": self.scenario, "seed": self.seed,
                "duration_s": self.duration_s, "job": self.job.to_dict(), "meta": self.meta,
                "events": [e.to_dict() for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        if not isinstance(d, dict) or d.get("format") != "resihp-trace v1":
            raise SimError("trace file must be a JSON object with format 'resihp-trace v1'")
        try:
            events = tuple(FailureEvent(**e) for e in d.get("events", []))
        except TypeError as e:
            raise SimError(f"trace events: {e}") from None
        return cls(job=JobSpec.from_dict(d["job"]), duration_s=float(d["duration_s"]), events=events,
                   scenario=str(d.get("scenario", "")), seed=int(d.get("seed", 0)),
                   meta=dict(d.get("meta", {})))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise SimError(f"trace file {path}: not JSON ({e})") from None


def severity_throughput(job: JobSpec, device: int, cause: str, loss: float, state: Any = None) -> float:
    """The p (compute) or link fraction (communication) of ``device`` whose unmitigated
    throughput loss on ``job`` is ``loss``: bisection with the planner's evaluator."""
    from resihp_core.scheduler.evaluate import Evaluator

    st = state if state is not None else job.state()
    healthy = st.evaluator.time(st.plan)

    def loss_at(x: float) -> float:
        sp = {device: x} if cause == "compute" else None
        lk = {device: x} if cause == "communication" else None
        return 1.0 - healthy / Evaluator(st.predictor, st.features, sp, lk).time(st.plan)

    lo, hi = 1e-3, 0.999
    if loss_at(lo) < loss:
        return lo
    for _ in range(30):
        mid = (lo + hi) / 2
        if loss_at(mid) > loss:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-4:
            break
    return round((lo + hi) / 2, 4)


def generate(scenario: str | Scenario, job: JobSpec, *, seed: int = 0, hours: float = 12.0,
             state: Any = None, calibration: dict[tuple[str, str], float] | None = None) -> Trace:
    """A seeded trace of ``scenario`` on ``job`` over ``hours`` of job time.

    Severity throughputs are calibrated once per (cause, severity) on a device of the
    middle stage (pass ``calibration`` to reuse them across seeds)."""
    sc = SCENARIOS.get(scenario) if isinstance(scenario, str) else scenario
    if sc is None:
        raise SimError(f"unknown scenario {scenario!r} (one of {', '.join(SCENARIOS)})")
    if not (hours > 0):
        raise SimError(f"hours must be > 0, got {hours!r}")
    duration = hours * 3600.0
    n = job.devices
    rng = random.Random(f"resihp-trace/{sc.name}/{seed}")
    events: list[FailureEvent] = []
    down_until: dict[int, float] = {}
    if sc.mtbf_s > 0:
        t = rng.expovariate(1.0 / sc.mtbf_s)
        while t < duration:
            d = rng.randrange(n)
            if down_until.get(d, -1.0) <= t:
                events.append(FailureEvent(round(t, 3), "stop", d))
                rep = t + sc.repair_s
                down_until[d] = rep
                if rep < duration:
                    events.append(FailureEvent(round(rep, 3), "repair", d))
            t += rng.expovariate(1.0 / sc.mtbf_s)
    cal = dict(calibration or {})
    meta: dict[str, Any] = {"mtbf_s": sc.mtbf_s, "repair_s": sc.repair_s,
                            "slow_every_s": sc.slow_every_s, "slow_for_s": sc.slow_for_s,
                            "severity": sc.severity}
    if sc.slow_every_s > 0:
        st = state
        slow_until: dict[int, float] = {}
        t = rng.expovariate(1.0 / sc.slow_every_s)
        while t < duration:
            d = rng.randrange(n)
            cause = rng.choice(sc.causes)
            sev = rng.choice(list(SEVERITY_LOSS)) if sc.severity == "mixed" else sc.severity
            dur = rng.expovariate(1.0 / sc.slow_for_s)
            busy = any(e.device == d and e.kind == "stop" and e.time <= t < e.time + sc.repair_s
                       for e in events)
            if not busy and slow_until.get(d, -1.0) <= t:
                if (cause, sev) not in cal:
                    if st is None:
                        st = job.state()
                    plan = st.plan
                    ref = plan.group(0, plan.pp // 2)[min(1, job.tp - 1)]
                    cal[(cause, sev)] = severity_throughput(job, ref, cause, SEVERITY_LOSS[sev], st)
                p = min(0.999, max(0.001, cal[(cause, sev)]))
                events.append(FailureEvent(round(t, 3), "slow", d, cause, p))
                end = t + dur
                slow_until[d] = end
                if end < duration:
                    events.append(FailureEvent(round(end, 3), "recover", d, cause))
            t += rng.expovariate(1.0 / sc.slow_every_s)
        meta["calibration"] = {f"{c}/{s}": v for (c, s), v in sorted(cal.items())}
    return Trace(job=job, duration_s=duration, events=tuple(events), scenario=sc.name, seed=seed,
                 meta=meta)
