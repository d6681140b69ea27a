"""A slow link every rank waits on (docs/detector.md "Slow links"): the profiles cannot
say whose link it is, so without a prober nothing is reported (what a rate limit on one
host's interface met); a link prober names the devices behind it. And the node link
probe's arithmetic (runtime/controller/linkprobe.py)."""

from __future__ import annotations

from typing import Sequence

from msgspec.structs import replace

import pytest

from resihp_core.detector import ProbeResult
from resihp_core.detector.changepoint import BOCPD
from resihp_core.detector.failslow import WorkloadAwareDetector
from resihp_core.detector.verify import ProfileVerifier
from resihp_core.runtime.controller.linkprobe import link_result
from test_detector_localise import Job


class HostLinks:
    """Devices 2 and 3 sit behind a link ``slow`` times slower than the others'."""

    measures_compute = False

    def __init__(self, slow: float) -> None:
        self.slow, self.calls = slow, 0

    def probe_compute(self, devices: Sequence[int]) -> ProbeResult:
        return ProbeResult({})

    def probe_links(self, devices: Sequence[int]) -> ProbeResult:
        self.calls += 1
        node_of = {d: d // 2 for d in devices}
        return link_result(node_of, {0: 0.004, 1: 0.004 * self.slow}, slack_s=0.1)


def run(prober: HostLinks | None, loaded: float = 1.0, waiting: float = 0.0) -> list:
    job = Job(ranks=4, scale=0.2, overhead=0.02, seed=11)
    det = WorkloadAwareDetector(BOCPD(), ProfileVerifier(), prober=prober, clock=lambda: 0.0)
    out = []
    for it in range(45):
        job.overhead = 0.02 if it < 30 else 1.0  # every rank waits ~1 s on the link from iteration 30
        job.slow = {r: loaded for r in range(4)} if it >= 30 else {}  # and computes slower, all alike
        ps = job.iteration(it)
        if waiting and it >= 30:  # rank 1 (unpinned) waits for a CPU part of its compute: 1.3x its peers
            p1 = ps[1]
            comp = sum(m.forward_s + m.backward_s for m in p1.microbatches)
            mbs = tuple(replace(m, forward_s=m.forward_s * (1 + waiting), backward_s=m.backward_s * (1 + waiting))
                        for m in p1.microbatches)
            ps = {**ps, **{r: replace(p, cpus=(0, 1, 2, 3)) for r, p in ps.items()},
                  1: replace(p1, microbatches=mbs, compute_wait_s=comp * waiting, cpu_wait_s=comp * waiting,
                             cpus=(0, 1, 2, 3))}
        d = det.observe(it, ps)
        if d.report is not None:
            out.append((it, d.report))
    return out


def test_a_link_every_rank_waits_on_is_reported_with_the_devices_behind_it_only_with_a_prober() -> None:
    assert run(None) == []  # the profiles alone cannot localise it: nothing (the symptom)
    prober = HostLinks(slow=100.0)
    got = run(prober)
    assert got and prober.calls >= 1
    it, report = got[0]
    assert report.cause == "communication" and report.devices == (2, 3)
    assert it - 30 + 1 <= 5
    assert all(p < 0.1 for p in report.throughput.values())


def test_a_link_on_a_machine_whose_load_slows_every_ranks_compute_alike_is_still_probed() -> None:
    # Compute 1.6x on every rank explains little of a 1 s wait: the link is probed, not
    # dismissed as a machine-wide slowdown (a rate-limited host's link at load 22).
    assert run(None, loaded=1.6) == []
    got = run(HostLinks(slow=100.0), loaded=1.6)
    assert got and got[0][1].cause == "communication" and got[0][1].devices == (2, 3)
    assert run(HostLinks(slow=1.0), loaded=1.6) == []


def test_a_link_is_probed_at_once_when_a_ranks_waiting_for_a_cpu_explains_little_of_the_slowdown() -> None:
    # An unpinned rank waiting 1.3x its peers would be deferred 12 iterations as the
    # scheduler's luck; the iteration lost ~1 s outside compute: the probe decides now.
    got = run(HostLinks(slow=100.0), waiting=0.3)
    assert got and got[0][1].cause == "communication" and got[0][1].devices == (2, 3)
    assert got[0][0] - 30 + 1 <= 5


def test_a_link_probe_that_finds_every_host_alike_reports_nothing() -> None:
    assert run(HostLinks(slow=1.0)) == []


def test_link_result_counts_a_node_slow_only_beyond_the_slack() -> None:
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    slow = link_result(node_of, {0: 0.01, 1: 0.41}, slack_s=0.1).throughput()
    assert slow[2] == slow[3] == pytest.approx(0.01 / 0.41) and slow[0] == slow[1] == 1.0
    noisy = link_result(node_of, {0: 0.01, 1: 0.08}, slack_s=0.1).throughput()
    assert set(noisy.values()) == {1.0}  # loaded-host jitter, not a link
    assert link_result({0: 0, 1: 0}, {0: 0.5}, slack_s=0.1).times == {}  # one host: nothing to compare
