"""Chaos matrix on the whole runtime: real workers, node agents, controller, Scheduler and
supervisor. Each scenario injects faults with ``fail_at`` and checks that the job
finishes every iteration and that every surviving worker's parameters and optimizer
state equal the fault-free single-process run (float64)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from resihp_core.config import DetectorConfig
from resihp_core.plan import Topology
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
from resihp_core.protocols.events import observer
from resihp_core.runtime.controller.payback import PaybackRule
from resihp_core.runtime.controller.resilient import ResilientConfig, RunHooks, run_resilient
from resihp_core.scheduler.planner import Planner
from resihp_core.scheduler.state import PlannerState
from resihp_adapters.megatron_ref.plugin import CAPABILITIES
from resihp_core.faults import fail_at

from .backend_harness import Finished, check_against_reference, job_spec, read_dumps, tmpdir, uniform

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Beats every 0.1 s, 3 s of silence to be declared: a 2-core CI machine runs 11+
# processes here, and a worker starved for 1.06 s (8 missed beats, the former limit) was
# taken for a hung device on a loaded machine; a dead process is seen at once anyway
# (exit, closed connection), a stopped one after the 3 s.
DETECTOR = DetectorConfig(heartbeat_interval_s=0.1, heartbeat_miss_limit=30, hang_min_timeout_s=20.0,
                          warmup_iterations=3, min_changepoint_gap=3)
# Fail-slow scenarios kill nothing: heartbeats may lapse 10 s (the controller's agent
# timeout becomes 20 s) so a worker or agent starved for a moment on a loaded machine
# is not taken for a hung device or a lost node.
SLOW_DETECTOR = dataclasses.replace(DETECTOR, heartbeat_miss_limit=100)
# The Detector's series of a generation starts at its third iteration (the first is
# not profiled, the next one skipped) and opens with warmup_iterations healthy ones.
# A change point needs 5 observations of the old level before it (BOCPD min_history),
# and with few of them one noisy iteration inflates the noise estimate (a median of
# successive differences) and can delay detection for many iterations; ONSET = 10
# leaves 8. A slowdown right after the warm-up (EARLY) can only be caught by the
# persistent-excess backstop (min_changepoint_gap iterations all over the threshold).
# Runs go on for SETTLE iterations: room for a late detection on a loaded machine,
# then iterations under the new plan.
ONSET = 10
EARLY = 5
SETTLE = 12


def _planner_state(plan, topology):
    corpus = CorpusSpec(scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64)
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8,
                                       ref_layers=plan.layers(0), ref_tp=1), plan.pp)
    pred = IterationPredictor(cost, topology, ModelShape(tokens=64, hidden=32, params_per_layer=10_000),
                              LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9))
    feats = workload_features(iteration_workload(corpus, 0, plan.dp, plan.num_microbatches),
                              plan.dp, plan.num_microbatches)
    return PlannerState.create(topology, plan, pred, feats, capabilities=CAPABILITIES), Planner(capabilities=CAPABILITIES)


def _chaos(plan, faults, iterations=6, detector=DETECTOR, **run_kw):
    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir(),
                    checkpoint_dir=tmpdir(), checkpoint_every=1,
                    faults=[f.to_dict() for f in faults])
    return run_checked(spec, plan, detector, iterations, **run_kw)


# These jobs end a few iterations after the slowdown they check the re-plan of: there a
# reconfiguration cannot pay back (docs/detector.md "Acting on a slowdown"), so until one
# is measured it is taken as free; the payback rule itself is tests/unit/test_payback.py's.
SHORT_JOB = PaybackRule(default_cost_s=0.0)


def hooks_of(*, before_run=None, on_iteration=None, on_detection=None, on_event=None) -> RunHooks:
    """The run's hooks: ``before_run`` and one observer of the iterations, the
    detections and the job's events."""
    observe = observer(iteration=on_iteration, detection=on_detection, job=on_event)
    return RunHooks(observe=observe) if before_run is None else RunHooks(observe=observe, before_run=before_run)


def run_checked(spec, plan, detector, iterations, observers=None, **hooks):
    """Run ``spec`` under the supervisor on two emulated nodes, then check every
    survivor against the fault-free float64 reference (``hooks``: :func:`hooks_of`'s)."""
    topology = Topology.uniform(2, len(plan.devices()) // 2)  # exactly the workers we start
    state, planner = _planner_state(plan, topology)
    run = run_resilient(ResilientConfig(spec=spec, plan=plan, topology=topology, state=state, planner=planner,
                                        detector=detector, iterations=iterations, workdir=Path(tmpdir()), timeout_s=240,
                                        observers=observers, payback=SHORT_JOB, hooks=hooks_of(**hooks)))
    assert run.ok, f"{run.error}; logs in {run.logs}"
    assert len(run.records) == iterations
    # Accounting comes from the job store of the supervised run; the harness checks
    # parameters and optimizer state of every survivor against the reference.
    check_against_reference(Finished(spec, read_dumps(spec), [r.loss for r in run.records], []), iterations)
    return run


def test_kill_one_tp_member_and_a_whole_tp_group_of_another_replica():
    plan = uniform(2, 2, 2, 3)
    member = plan.group(0, 1)[1]
    group = plan.group(1, 0)
    run = _chaos(plan, [fail_at(member, 2, "kill"), fail_at(group[0], 4, "kill"), fail_at(group[1], 4, "kill")])
    assert any(e["kind"] == "plan" and e["generation"] >= 1 for e in run.events)


def test_last_replica_of_a_stage_lost_restores_from_checkpoint():
    plan = uniform(1, 2, 2, 3)
    stage1 = [plan.group(0, 1)[0], plan.group(1, 1)[0]]
    run = _chaos(plan, [fail_at(d, 3, "kill") for d in stage1])
    assert any("restore" in e["text"] for e in run.events if e["kind"] == "plan")


def test_stopped_worker_is_fenced_and_the_job_goes_on():
    plan = uniform(1, 2, 2, 3)
    run = _chaos(plan, [fail_at(plan.group(1, 1)[0], 3, "stop")])
    # The stopped worker is reported fail-stop (a contention fail-slow of another device
    # on a loaded machine may come first; it is not what this test is about).
    stops = [e for e in run.events if e["kind"] == "failure" and e["failure"] == "fail-stop"]
    assert stops and stops[0]["devices"] == [plan.group(1, 1)[0]], run.events


# ------------------------------------------------------------------ fail-slow
def _slow_reports(run):
    return [e for e in run.events if e["kind"] == "failure" and e["failure"] == "fail-slow"]


def _work(plan, device):
    """Layer x micro-batch work units ``device`` computes in ``plan`` (0 if it has none)."""
    where = plan.location(device)
    if where is None:
        return 0.0
    r, s, _ = where
    return plan.layers(s) * len(plan.work(r, s)) / plan.degree(r, s)


def _assert_adapted(run, plan, slow, cause):
    """The Detector reported exactly ``slow`` with ``cause``, the Scheduler posted
    a new generation that took work away from every slow device, and the job committed
    iterations under it. Returns the final plan and the devices of other fail-slow
    reports: on a loaded 2-core machine a starved device's host contention may be
    reported too (filtered out by device, as the Scheduler may act on it as well)."""
    reports = _slow_reports(run)
    ours = [e for e in reports if set(e["devices"]) & set(slow)]
    # Once, or again after a first plan that only lightened the device: on a loaded
    # machine the first estimate may be low (1.7x of a 10x slowdown, re-reported at
    # 4.2x under the new plan); every such report names exactly ``slow`` and ``cause``.
    assert ours and all((sorted(e["devices"]), e["cause"]) == (sorted(slow), cause) for e in ours), run.events
    others = {d for e in reports if e not in ours for d in e["devices"]}
    assert not [e for e in run.events if e["kind"] == "failure" and e["failure"] != "fail-slow"], run.events
    assert any(e["kind"] == "plan" and e["generation"] >= 1 for e in run.events), run.events
    assert any(r.generation >= 1 for r in run.records), [(r.iteration, r.generation) for r in run.records]
    final = run.final_plan
    for d in slow:
        assert _work(final, d) < _work(plan, d), f"device {d} keeps its work:\n{final.to_text()}"
    return final, others


def test_compute_fail_slow_of_a_tp_member_is_reported_and_only_it_is_dropped():
    plan = uniform(2, 2, 1, 3)
    member = plan.group(0, 1)[1]
    run = _chaos(plan, [fail_at(member, ONSET, "slow", factor=10.0)], iterations=ONSET + SETTLE,
                 detector=SLOW_DETECTOR)
    final, others = _assert_adapted(run, plan, [member], "compute")
    # TP selective exclusion: the slow member leaves, every device nothing was reported
    # of keeps running.
    assert member not in final.devices(), final.to_text()
    assert set(final.devices()) >= set(plan.devices()) - {member} - others, final.to_text()


def test_compute_fail_slow_of_the_last_replica_of_a_stage_right_after_warm_up_moves_layers_away():
    # DP 1: no peer replica can take the slow stage's micro-batches, TP 1: no member to
    # drop; what is left is the pipeline: the Scheduler moves layers off the slow stage.
    plan = uniform(1, 2, 1, 3)
    device = plan.group(0, 1)[0]
    run = _chaos(plan, [fail_at(device, EARLY, "slow", factor=10.0)], iterations=EARLY + SETTLE,
                 detector=SLOW_DETECTOR)
    final, _ = _assert_adapted(run, plan, [device], "compute")
    assert final.layers(1) < plan.layers(1), final.to_text()


def _job_processes(job_path: str) -> dict[int, str]:
    """pid -> command line of every live process started for the job at ``job_path``."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours
            continue
        if f"RESIHP_JOB={job_path}".encode() in env:
            out[int(pid)] = cmd
    return out


def test_contention_then_a_slow_link_on_one_device_leave_training_exact_and_nothing_behind():
    # One job, two faults on the two stage-1 devices: CPU contention on one from
    # iteration 2, delayed communication on the other from iteration EARLY (so a
    # re-plan around the contended device cannot take the slow link out of the job).
    #
    # Contention: correctness only, no detection: the busy process competes for both
    # cores of this machine, not for the device's own (nothing is pinned), so every
    # worker slows a little and nothing points at the contended device; in a trial with
    # contention from iteration 7 of 11 the Detector saw no change point at all (the
    # machine is oversubscribed already). Its busy process must run during the job and
    # end with it.
    #
    # Communication: what the Detector makes of it is not asserted: one device's delayed
    # receives make every rank wait (pipeline and DP sync), so the excess outside compute
    # is spread over the job and the profile verifier cannot localise it without a link
    # prober, which run_resilient does not give it (verdict "unknown", nothing reported);
    # on a loaded machine compute-timing noise on some other rank may instead be reported
    # as a compute fail-slow of that rank, and the job is reconfigured around a healthy
    # device. Either way training must stay exact.
    plan = uniform(1, 2, 2, 3)
    contended = plan.group(0, 1)[0]
    device = plan.group(1, 1)[0]  # stage 1: 3 activation receives + 1 gradient reduction
    delay = 0.1
    seen = {}
    job = {}
    busy: set[int] = set()

    def before_run(j, agents):
        job["path"] = str(j.job_path)

    def on_iteration(rec):
        if rec.iteration >= 2 and not busy:
            busy.update(p for p, cmd in _job_processes(job["path"]).items() if "getppid" in cmd)

    _chaos(plan, [fail_at(contended, 2, "contend"), fail_at(device, EARLY, "comm", delay_s=delay)],
           iterations=EARLY + 5, detector=SLOW_DETECTOR, before_run=before_run, on_iteration=on_iteration,
           on_detection=lambda d: seen.setdefault(d.iteration, d.measured))
    # The first iteration with the slow link completes under the first plan (a report
    # needs two faulty iterations or more): its slowest rank took at least the delays
    # the device slept through (contention only adds to it).
    assert seen.get(EARLY, 0.0) >= 4 * delay, seen
    assert busy, "no contending process was running during the job"
    deadline = time.monotonic() + 10
    while _job_processes(job["path"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _job_processes(job["path"]), "processes of the job outlived it"


def test_one_sigkill_is_one_failure_on_the_prometheus_endpoint():
    """The controller and the supervisor both see a killed worker; observers hear of it
    once (the supervisor notifies them), so ``resihp_failures_total`` is 1."""
    import urllib.request

    from resihp_core.plugins import Plugins
    from resihp_plugins.prometheus import PrometheusExporter

    exporter = PrometheusExporter()
    observers = Plugins(autoload=False, builtins=[])
    observers.register(exporter, "prometheus")
    port = exporter.serve(0)
    try:
        plan = uniform(1, 2, 2, 2)
        _chaos(plan, [fail_at(plan.group(1, 1)[0], 2, "kill")], iterations=4, observers=observers)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            body = r.read().decode()
    finally:
        exporter.shutdown()
    # Fail-stop series only: on a loaded machine the Detector may also report a starved
    # device's host contention (a fail-slow); that is another failure, not a double count.
    counts = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
              if line.startswith('resihp_failures_total{failure="fail-stop"')]
    assert sum(counts) == 1, body
    assert 'resihp_failures_total{failure="fail-stop",cause="unknown"} 1' in body, body
