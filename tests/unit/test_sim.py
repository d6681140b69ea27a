"""The cluster simulator: traces replay exactly, the engine's accounting is right, the
policies behave as their sources describe, and the reports compute what they say."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from resihp_core.cli import main
from resihp_core.hookspecs import hookimpl
from resihp_core.plugins import Plugins
from resihp_core.sim.cluster import Costs, JobSpec, SimError
from resihp_core.sim.detection import estimate
from resihp_core.sim.engine import run
from resihp_core.sim.optimum import compositions, enumerate_plans, optimum
from resihp_core.sim.report import amplification, ci95, policy, summarise, sweep
from resihp_core.sim.trace import FailureEvent, Trace, generate, severity_throughput

JOB = JobSpec()  # LLaMA-2 7B, tp4 pp2 dp2, 16 micro-batches: SPEC §7's 16-device job


@pytest.fixture(scope="module")
def state0():
    return JOB.state()


# ------------------------------------------------------------------ traces
def test_trace_is_seeded_and_round_trips_through_a_file(tmp_path: Path, state0) -> None:
    a = generate("mixed", JOB, seed=3, hours=6, state=state0)
    b = generate("mixed", JOB, seed=3, hours=6, state=state0)
    c = generate("mixed", JOB, seed=4, hours=6, state=state0)
    assert a.events == b.events and a.events != c.events
    assert {e.kind for e in a.events} >= {"stop", "slow"}
    back = Trace.load(a.save(tmp_path / "t.json"))
    assert back == replace(a, meta=back.meta) and back.events == a.events
    # Every stop is followed by its repair after the repair time (when inside the trace).
    for e in a.events:
        if e.kind == "stop" and e.time + 3600 < a.duration_s:
            assert any(r.kind == "repair" and r.device == e.device and
                       abs(r.time - e.time - 3600) < 1e-2 for r in a.events)


def test_trace_replays_exactly(tmp_path: Path, state0) -> None:
    tr = Trace.load(generate("stop-1h", JOB, seed=1, hours=3, state=state0).save(tmp_path / "t.json"))
    r1 = run(tr, policy("resihp"), state0=state0)
    r2 = run(Trace.load(tmp_path / "t.json"), policy("resihp"), state0=state0)
    assert r1.samples == r2.samples and r1.segments == r2.segments
    assert [l["what"] for l in r1.log] == [l["what"] for l in r2.log]


def test_trace_errors_name_the_field() -> None:
    with pytest.raises(SimError, match="unknown scenario 'nope'"):
        generate("nope", JOB)
    with pytest.raises(SimError, match="names device 99"):
        Trace(JOB, 100.0, (FailureEvent(1.0, "stop", 99),))
    with pytest.raises(SimError, match="cause must be compute or communication"):
        FailureEvent(1.0, "slow", 2, "disk", 0.5)
    with pytest.raises(SimError, match=r"job.tp must be an int >= 1"):
        JobSpec(tp=0)
    with pytest.raises(SimError, match=r"costs.restart_s"):
        Costs(restart_s=-1)
    with pytest.raises(SimError, match="format 'resihp-trace v1'"):
        Trace.from_dict({"events": []})


def test_severity_calibration_matches_spec_losses(state0) -> None:
    dev = state0.plan.group(0, 1)[1]
    healthy = state0.evaluator.time(state0.plan)
    from resihp_core.scheduler.evaluate import Evaluator

    for loss in (0.35, 0.70):
        p = severity_throughput(JOB, dev, "compute", loss, state0)
        t = Evaluator(state0.predictor, state0.features, {dev: p}).time(state0.plan)
        assert abs((1 - healthy / t) - loss) < 0.01


# ------------------------------------------------------------------ engine
def test_fault_free_trace_keeps_full_throughput(state0) -> None:
    tr = Trace(JOB, 3600.0, (), scenario="none")
    t0 = state0.evaluator.time(state0.plan)
    for name in ("resihp", "none", "recycle", "greyhound", "adaptra", "oobleck", "enh-oobleck"):
        pol = policy(name)
        r = run(tr, pol, state0=state0)
        own = state0.evaluator.time(pol.plan)  # Oobleck runs its own pipeline-major layout
        assert r.retained == pytest.approx(t0 / own, abs=1e-9), name
        assert (own == t0) == (name not in ("oobleck", "enh-oobleck")), name


def test_restart_accounting_by_hand(state0) -> None:
    """No mitigation: a stop at 1500 s loses everything since the 1000 s checkpoint and
    pays the heartbeat and the restart, then runs the restart layout."""
    costs = Costs(checkpoint_interval_s=1000.0, restart_s=50.0, heartbeat_detect_s=1.0)
    tr = Trace(JOB, 3000.0, (FailureEvent(1500.0, "stop", 5),), scenario="by-hand")
    r = run(tr, policy("none"), costs=costs, state0=state0)
    t0 = state0.evaluator.time(state0.plan)
    restart = [l for l in r.log if l.get("rollback") == "checkpoint"]
    assert len(restart) == 1 and restart[0]["t"] == pytest.approx(1501.0)
    down, t_new = restart[0]["downtime_s"], restart[0]["iteration_s"]
    assert down > 50.0 and t_new > t0  # fewer devices after the restart
    expected = JOB.global_batch * (1000.0 / t0 + (3000.0 - 1501.0 - down) / t_new)
    assert r.samples == pytest.approx(expected, rel=1e-6)
    assert min(s.throughput for s in r.segments) == 0.0


def test_resihp_keeps_more_than_restarting_and_recovers_after_repair(state0) -> None:
    tr = Trace(JOB, 7200.0, (FailureEvent(600.0, "stop", 9), FailureEvent(4200.0, "repair", 9)))
    res = run(tr, policy("resihp"), state0=state0)
    none = run(tr, policy("none"), state0=state0)
    recycle = run(tr, policy("recycle"), state0=state0)
    assert res.retained > recycle.retained > none.retained
    # After the repair ResiHP is back to fault-free speed.
    assert res.segments[-1].throughput == pytest.approx(res.healthy_throughput, rel=1e-6)


def test_greyhound_misses_a_compute_straggler_below_twice_the_median(state0) -> None:
    dev = state0.plan.group(0, 1)[1]
    p = severity_throughput(JOB, dev, "compute", 0.35, state0)
    assert 1 / p < 2.0  # weak: the rank is not 2x slower than the median
    tr = Trace(JOB, 3600.0, (FailureEvent(300.0, "slow", dev, "compute", p),))
    grey = run(tr, policy("greyhound"), state0=state0)
    none = run(tr, policy("none"), state0=state0)
    res = run(tr, policy("resihp"), state0=state0)
    assert grey.samples == pytest.approx(none.samples)
    assert res.retained > none.retained + 0.05
    assert not any("greyhound handles" in l["what"] for l in grey.log)


def test_detection_estimates_follow_the_detectors_rules() -> None:
    assert estimate("resihp", 1.1, "compute", 1.2).latency is None  # below 1 + slow_threshold
    hit = estimate("resihp", 2.0, "compute", 3.0)
    assert hit.latency is not None and 1 <= hit.latency <= 20 and hit.false_alarms == 0.0
    assert estimate("greyhound", 1.6, "compute", 1.8).latency is None  # < 2x median
    assert estimate("greyhound", 1.6, "communication", 1.8).latency is not None  # > 1.1x


# ------------------------------------------------------------------ plugins
def test_policies_are_plugins() -> None:
    from resihp_core.sim.policies import Policy

    class Idle(Policy):
        name = "idle"

    class Mine:
        @hookimpl
        def resihp_register_sim_policies(self, registry):
            registry.register("idle", Idle)

    plugins = Plugins(autoload=False)
    reg = plugins.sim_policies()
    assert {"resihp", "none", "recycle", "oobleck", "greyhound", "adaptra", "enh-recycle",
            "enh-oobleck"} <= set(reg.names())
    plugins.register(Mine(), "mine")
    assert isinstance(plugins.sim_policies().create("idle"), Idle)
    for name in reg.names():  # every built-in says what it does and what it simplifies
        doc = type(reg.create(name)).__doc__ or ""
        assert "implified" in doc and len(doc) > 150, name


# ------------------------------------------------------------------ reports
def test_ci95_is_student_t() -> None:
    assert ci95([2.0, 2.0, 2.0]) == (2.0, 0.0)
    mean, hw = ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and hw == pytest.approx(4.303 / math.sqrt(3), rel=1e-4)
    assert ci95([5.0]) == (5.0, 0.0)


def test_sweep_summary_ratios(state0) -> None:
    out = sweep(JOB, ["stop-1h"], ["resihp", "none"], seeds=2, hours=2)
    s = summarise(out)["stop-1h"]
    runs = out["results"]["stop-1h"]
    ratios = [a.throughput / b.throughput for a, b in zip(runs["resihp"], runs["none"])]
    assert s["none"]["resihp_over"] == pytest.approx(sum(ratios) / 2)
    assert s["resihp"]["seeds"] == 2 and 0 < s["resihp"]["retained"] <= 1.0


def test_idle_gpu_amplification_and_its_mitigation() -> None:
    a = amplification(JOB)
    u, m = a["unmitigated"], a["mitigated"]
    assert u["tp"] > 0 and u["pp"] > 0 and u["dp"] > 0
    assert a["amplification"] > 3.0  # one slow device idles many others
    assert a["amplification_mitigated"] < a["amplification"]
    assert a["mitigated_iteration_s"] < a["slow_iteration_s"]


# ------------------------------------------------------------------ optimum
def test_compositions() -> None:
    assert len(compositions(8, 4)) == 35
    assert compositions(4, 2, [2, 3]) == [(1, 3), (2, 2)]


def test_enumerated_optimum_contains_the_unmitigated_plan_and_bounds_it() -> None:
    from resihp_core.protocol import FailureReport
    from resihp_core.scheduler import DEFAULT_STAGES, Planner, apply_report
    from resihp_core.sim.jobs import ModelSpec, job_state

    st = job_state(tp=2, pp=2, dp=2, num_microbatches=4, model=ModelSpec("t", 4, 4096, 202e6, 32))
    dev = st.plan.group(0, 1)[1]
    rep = FailureReport(generation=0, failure="fail-slow", devices=(dev,), cause="compute",
                        throughput={dev: 0.4})
    failed = apply_report(st, rep)
    plans = enumerate_plans(failed)
    keys = {(p.tp_groups, p.layer_ranges, p.migrations) for p in plans}
    assert len(keys) == len(plans)
    assert (st.plan.tp_groups, st.plan.layer_ranges, ()) in keys
    best = optimum(failed)
    assert best.time <= failed.evaluator.time(st.plan)
    assert all(failed.evaluator.time(p) >= best.time - 1e-12 for p in plans[:50])
    planner = failed.evaluator.time(Planner(stages=DEFAULT_STAGES).plan(st, rep).plan)
    assert planner <= best.time * 1.05


# ------------------------------------------------------------------ CLI
def test_cli_simulate_writes_json_and_replays_a_trace_file(tmp_path: Path, capsys, state0) -> None:
    out = tmp_path / "s.json"
    rc = main(["simulate", "stop-1h", "--hours", "1", "--seeds", "1", "--policies", "resihp,none",
               "--json", str(out), "--traces", str(tmp_path / "tr"), "--plot", str(tmp_path / "p.png"),
               "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["summary"]["stop-1h"]) == {"resihp", "none"}
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "retained" in text and "resihp" in text
    (trace_file,) = (tmp_path / "tr").glob("*.json")
    events = Trace.load(trace_file).events
    for r in data["runs"]:  # every trace event is in every run's log, in order
        assert [e["what"].split()[0] for e in r["log"] if e.get("truth")] == [e.kind for e in events]
    out2 = tmp_path / "s2.json"
    assert main(["simulate", str(trace_file), "--policies", "resihp,none", "--json", str(out2),
                 "--no-progress"]) == 0
    again = json.loads(out2.read_text())
    assert again["summary"]["stop-1h"]["resihp"]["throughput"] == pytest.approx(
        data["summary"]["stop-1h"]["resihp"]["throughput"], rel=1e-12)


def test_cli_simulate_bad_input(capsys) -> None:
    assert main(["simulate", "stop-1h", "--policies", "resihp,bogus", "--no-progress"]) == 2
    assert "unknown policy bogus" in capsys.readouterr().err
    assert main(["simulate", "no-such-scenario", "--no-progress"]) == 2
    assert "neither a scenario name" in capsys.readouterr().err


def test_calibration_layouts_predict_a_gain_from_adaptation() -> None:
    from resihp_core.sim.calibration import predicted_ratio

    pp = predicted_ratio("one_core_pp")
    dp = predicted_ratio("one_core_dp")
    # A 2.22x compute slowdown costs about 55 % unmitigated (SPEC's medium severity) ...
    assert 0.45 < pp["unmitigated_loss"] < 0.6 and 0.45 < dp["unmitigated_loss"] < 0.6
    # ... and each layout's one applicable dimension wins back most of it.
    assert "layers (4, 4) -> " in pp["plan"] and pp["ratio"] > 1.3
    assert "migrated" in dp["plan"] and dp["ratio"] > 1.3
