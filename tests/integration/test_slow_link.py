"""A slow link made by the operating system (docs/detector.md "Slow links"): a two-host
job (network namespaces, as tests/integration/test_multihost.py builds them), one host's
interface rate-limited by the kernel's traffic control (``tc qdisc ... tbf``) while the
job runs. Reported as ``communication`` naming that host's devices (asserted when the
throttle at least doubled the iteration time: on a loaded machine the healthy iterations
can be as slow as the throttled ones), within 5 iterations on a quiet machine; no device
fails, never another host's devices, the parameters equal the fault-free run.

Skips with the reason where namespaces or ``tc``/``tbf`` are not available. The latency
target is asserted when processes outside the test used at most a quarter of its cores'
time over the run (as tests/integration/test_detector_external.py); the figures are
printed either way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resihp_core.plan import Topology
from resihp_core.protocols.events import observer
from resihp_core.runtime.controller.resilient import AgentSetup, ResilientConfig, RunHooks, run_resilient
from resihp_core.testing.outside_load import OutsideLoad

from .backend_harness import job_spec, tmpdir, uniform
from .netns import Hosts, tc_unavailable
from .test_chaos import SLOW_DETECTOR, _planner_state
from .test_multihost import Cluster, _check_parameters, _events, _when

WHY = tc_unavailable()
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300), pytest.mark.skipif(bool(WHY), reason=WHY)]
THROTTLE_AT = 12  # committed iterations: after the warm-up the healthy model is fitted on
RATE = "1mbit"


def test_a_hosts_link_rate_limited_by_tc_is_reported_as_communication_of_its_devices() -> None:
    plan = uniform(1, 2, 2, 4)  # replica r: stage 0 on node 0, stage 1 on node 1 (a boundary per replica)
    topology = Topology.uniform(2, 2)
    behind = sorted(topology.nodes()[1])  # devices of the throttled host
    iterations = THROTTLE_AT + 10  # throttled iterations are slow (0.6-3 s): a few more than detection needs
    work = Path(tmpdir())
    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir())
    state, planner = _planner_state(plan, topology)
    outside = OutsideLoad()
    loads: list[float] = []
    at: dict[str, int] = {}
    seconds: list[float] = []
    detections: list = []

    def on_iteration(rec) -> None:
        outside.sample()
        loads.append(os.getloadavg()[0])
        seconds.append(rec.seconds)

    with Hosts(2) as hosts:
        cluster = Cluster(hosts, {0: 0, 1: 1}, work)

        def throttle(job) -> None:
            at["throttled"] = job.committed
            hosts.throttle(1, RATE)

        try:
            run = run_resilient(ResilientConfig(
                spec=spec, plan=plan, topology=topology, state=state, planner=planner, detector=SLOW_DETECTOR,
                iterations=iterations, workdir=work / "job", timeout_s=240,
                agents=AgentSetup(mode="external", listen=(hosts.address, 0), secret=cluster.secret, timeout_s=60),
                hooks=RunHooks(on_listening=cluster.on_listening,
                               observe=observer(iteration=on_iteration, detection=detections.append),
                               before_run=lambda job, _: _when(job, THROTTLE_AT, lambda: throttle(job)))))
            assert run.ok, f"{run.error}; logs in {run.logs} and {work}"
            cluster.assert_clean_end()
        finally:
            hosts.unthrottle(1)
            cluster.close()
    failures = [e for e in run.events if e["kind"] == "failure"]
    links = [e for e in failures if e.get("cause") == "communication"]
    before = sorted(seconds[:THROTTLE_AT])[THROTTLE_AT // 2] if len(seconds) > THROTTLE_AT else 0.0
    after = sorted(seconds[THROTTLE_AT:])[len(seconds[THROTTLE_AT:]) // 2] if len(seconds) > THROTTLE_AT else 0.0
    quiet = outside.quiet(0.25)
    print(f"throttled host 1 ({RATE}) at iteration {at.get('throttled')}: median {before:.3f} -> {after:.3f} s/it; "
          f"reports: {[(e['iteration'], e['cause'], e['devices']) for e in failures]}; load average "
          f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f}, {outside.describe()}; latency target "
          f"{'asserted' if quiet else 'not asserted (a shared machine)'}")
    print("\n".join(f"{e['iteration']} {e['text'][:300]}" for e in run.events if e["kind"] in ("replan", "plan")))
    print("detections:", *[(d.iteration, d.action, d.verdict and d.verdict.rule, d.verdict and d.verdict.evidence[:200])
                            for d in detections if d.action not in ("none", "warmup")], sep="\n  ")
    assert "throttled" in at, _events(run)
    assert not [e for e in failures if e.get("failure") == "fail-stop"], _events(run)
    _check_parameters(spec, run, iterations)
    assert not [e for e in links if e["devices"] != behind], _events(run)  # never another host's devices
    if after < 2 * before:  # on a loaded machine the healthy iterations are slow too: within their noise
        print(f"the throttle slowed iterations {after / max(before, 1e-9):.2f}x only: detection not asserted")
        return
    assert links, _events(run)  # a link that doubles the iteration is reported whatever the load
    assert links[0]["devices"] == behind, _events(run)
    # The plan says what it does about that host's link: moved off, or what still crosses it
    # and why (scheduler/links.py; this adapter cannot move stages between devices).
    assert [e for e in run.events if e["kind"] in ("plan", "replan")
            and f"the link of node 1 (devices {behind}" in e["text"]], _events(run)
    if quiet:
        assert links[0]["iteration"] - at["throttled"] <= 5, _events(run)
        assert not [e for e in failures if e["iteration"] < at["throttled"]], _events(run)  # none before it
