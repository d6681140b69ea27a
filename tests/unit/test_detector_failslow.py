"""Workload-aware fail-slow detection, the baseline, the healthy model, the plugin wiring."""

from __future__ import annotations

import random
import time as _t

import pytest

from resihp_core.config import DetectorConfig
from resihp_core.detector import FailSlowDetector, ProbeResult
from resihp_core.detector.changepoint import BOCPD, GreyhoundChangePoint
from resihp_core.detector.failslow import (
    ChangePointOnlyDetector,
    WorkloadAwareDetector,
    build_baseline_detector,
    build_failslow_detector,
)
from resihp_core.detector.model import ModelNotReady, WorkloadModel, measured_iteration_time
from resihp_core.detector.verify import GreyhoundVerifier, ProfileVerifier
from resihp_core.plan import ParallelPlan, Topology
from resihp_core.plugins import Plugins
from resihp_core.predictor.corpus import CorpusSpec, packed_microbatches
from resihp_core.predictor.predict import ModelShape
from resihp_core.protocol import IterationProfile, MicroBatchProfile

ALPHA, BETA = 2e-6, 1.5e-9  # forward s/token, s/token^2 (backward: twice)
N = 2048


class Trace:
    """DP replicas of one stage each (TP 1): iteration time = the slowest replica."""

    def __init__(self, ranks: int = 4, m: int = 4, seed: int = 0) -> None:
        self.ranks, self.m = ranks, m
        self.rng = random.Random(seed)
        self.short = packed_microbatches(CorpusSpec(scale=100, shape=0.8, token_budget=N, seed=seed), 512)
        self.long = packed_microbatches(CorpusSpec(scale=1500, shape=0.8, token_budget=N, seed=seed), 512)
        self.slow: dict[int, float] = {}  # rank -> compute factor (the device)
        # rank -> compute factor from other processes holding the CPU: the extra time is
        # run delay (compute_wait_s), as the worker measures it
        self.contended: dict[int, float] = {}
        self.base_wait = 0.0  # share of compute a healthy rank waits for a CPU anyway
        self.long_docs = False
        # The CPUs each rank may run on (IterationProfile.cpus): pinned, one core each, by
        # default; "shared" = every rank on every core; "unknown" = not reported.
        self.affinity = "pinned"

    def cpus(self, r: int) -> tuple[int, ...]:
        return {"pinned": (r,), "shared": tuple(range(self.ranks)), "unknown": ()}[self.affinity]

    def iteration(self, it: int, noise: float = 0.02) -> dict[int, IterationProfile]:
        pool = self.long if self.long_docs else self.short
        out = {}
        work = {r: [self.rng.choice(pool) for _ in range(self.m)] for r in range(self.ranks)}
        comps = {}
        waits = {}
        for r in range(self.ranks):
            f = self.slow.get(r, 1.0)
            c = self.contended.get(r, 1.0)
            mbs = []
            waits[r] = 0.0
            for j, lengths in enumerate(work[r]):
                t = (ALPHA * sum(lengths) + BETA * sum(l * l for l in lengths)) * f
                e = 1 + self.rng.gauss(0, noise)
                mbs.append(MicroBatchProfile(owner=r, mb=j, forward_s=t * e * c, backward_s=2 * t * e * c,
                                             doc_lengths=lengths))
                waits[r] += 3 * t * e * (c - 1 + self.base_wait)
            comps[r] = mbs
        total = max(sum(x.forward_s + x.backward_s for x in mbs) for mbs in comps.values()) + 0.001
        for r, mbs in comps.items():
            comp = sum(x.forward_s + x.backward_s for x in mbs)
            out[r] = IterationProfile(rank=r, device=10 + r, generation=0, iteration=it, stage=0, replica=r,
                                      microbatches=tuple(mbs), comm_s=total - comp, iteration_s=total,
                                      cpu_wait_s=waits[r] * 1.05, compute_wait_s=waits[r], cpus=self.cpus(r))
        return out


def resihp(series: str = "normalised", **kw) -> WorkloadAwareDetector:
    return WorkloadAwareDetector(BOCPD(), ProfileVerifier(), series=series, **kw)


def feed(det: FailSlowDetector, trace: Trace, start: int, stop: int) -> list:
    return [det.observe(it, trace.iteration(it)) for it in range(start, stop)]


# ------------------------------------------------------------------ the workload-aware detector
@pytest.mark.parametrize("series", ["normalised", "raw"])
def test_a_compute_slowdown_is_reported_with_device_cause_and_throughput(series: str) -> None:
    trace = Trace()
    det = resihp(series)
    assert isinstance(det, FailSlowDetector)
    before = feed(det, trace, 0, 40)
    assert not [d for d in before if d.report is not None]
    trace.slow[2] = 2.0
    after = feed(det, trace, 40, 50)
    reported = [d for d in after if d.report is not None]
    assert reported, [d.action for d in after]
    d = reported[0]
    assert d.iteration - 40 + 1 <= 3  # latency in iterations, the onset included
    r = d.report
    assert r.failure == "fail-slow" and r.devices == (12,) and r.cause == "compute"
    assert r.throughput[12] == pytest.approx(0.5, abs=0.06)
    assert det.stats.reports == 1 and det.stats.verifications == 1


@pytest.mark.parametrize("noise", [0.02, 0.15])
def test_a_slowdown_right_after_warmup_is_reported(noise: float) -> None:
    """Too little history for a change point (1 skipped + 3 warm-up + 1 healthy): the
    sustained excess over the prediction is what finds it, within min_gap + 1."""
    trace = Trace(seed=3)
    det = resihp(warmup_iterations=3, min_gap=3)
    acts = [det.observe(it, trace.iteration(it, noise=noise)).action for it in range(5)]
    assert acts == ["warmup"] * 4 + ["none"]
    trace.slow[1] = 2.5
    after = [det.observe(it, trace.iteration(it, noise=noise)) for it in range(5, 12)]
    reported = [d for d in after if d.report is not None]
    assert reported and reported[0].iteration <= 5 + 3, [d.action for d in after]
    assert reported[0].report.devices == (11,) and "sustained excess" in reported[0].notes[-1]
    # a healthy series with the same noise never triggers it
    quiet = resihp(warmup_iterations=3, min_gap=3)
    assert not [d for d in feed_noisy(quiet, Trace(seed=4), 60, noise) if d.action not in ("warmup", "none")]


def feed_noisy(det: FailSlowDetector, trace: Trace, n: int, noise: float) -> list:
    return [det.observe(it, trace.iteration(it, noise=noise)) for it in range(n)]


def test_a_known_slow_device_is_not_reported_again_in_the_next_generation() -> None:
    trace = Trace()
    det = resihp()
    feed(det, trace, 0, 20)
    trace.slow[2] = 2.0
    assert [d.report.devices for d in feed(det, trace, 20, 30) if d.report is not None] == [(12,)]
    # the Scheduler adapted around it; the device stays slow in the new generation
    det.reset(1, speeds={12: 0.5})
    assert not [d for d in feed(det, trace, 30, 60) if d.report is not None]
    # a further slowdown of it (6x, beyond the known 2x) is still news
    trace.slow[2] = 6.0
    assert [d.report.devices for d in feed(det, trace, 60, 75) if d.report is not None] == [(12,)]


def test_a_workload_shift_is_benign_for_resihp_but_verified_by_the_baseline() -> None:
    trace = Trace(seed=1)
    raw = resihp("raw")
    base = ChangePointOnlyDetector(GreyhoundChangePoint(), GreyhoundVerifier())
    for it in range(40):
        p = trace.iteration(it)
        raw.observe(it, p)
        base.observe(it, p)
    trace.long_docs = True  # documents get long: attention cost, not a failure
    acts, base_acts = [], []
    for it in range(40, 70):
        p = trace.iteration(it)
        acts.append(raw.observe(it, p))
        base_acts.append(base.observe(it, p))
    assert raw.stats.change_points >= 1
    assert "benign" in [d.action for d in acts]
    assert raw.stats.verifications == 0 and raw.stats.reports == 0
    benign = next(d for d in acts if d.action == "benign")
    assert benign.ratio is not None and benign.ratio < 1.25
    # The baseline pays a verification (here without a prober its 1.1x-median rule on
    # the profiles' waiting times may even name a healthy device).
    assert base.stats.verifications >= 1


def test_normalised_series_hardly_moves_on_a_workload_shift() -> None:
    trace = Trace(seed=2)
    det = resihp()
    feed(det, trace, 0, 30)
    trace.long_docs = True
    feed(det, trace, 30, 60)
    assert det.stats.verifications == 0 and det.stats.reports == 0


def test_a_known_failure_is_not_reported_again() -> None:
    trace = Trace(seed=3)
    det = resihp(min_gap=2)
    feed(det, trace, 0, 30)
    trace.slow[1] = 2.5
    feed(det, trace, 30, 40)
    assert det.stats.reports == 1
    # The model now expects device 11 at p = 0.4: the series is back to "healthy".
    assert det.model.speeds[11] == pytest.approx(0.4, abs=0.05)
    feed(det, trace, 40, 80)
    assert det.stats.reports == 1


def test_warmup_and_reset() -> None:
    trace = Trace(seed=4)
    det = resihp(warmup_iterations=3)
    acts = [d.action for d in feed(det, trace, 0, 6)]
    assert acts[:4] == ["warmup"] * 4  # 1 skipped + 3 fitted
    assert det.model.ready
    det.reset(5)
    assert det.generation == 5 and not det.model.ready
    assert det.observe(0, trace.iteration(0)).action == "warmup"


def test_an_injected_predictor_is_used() -> None:
    trace = Trace(seed=5)
    calls = []

    def predict(it: int, profiles) -> float:
        calls.append(it)
        return measured_iteration_time(profiles) / 2.0  # claims everything is 2x slow

    det = resihp(predict_healthy=predict)
    out = feed(det, trace, 0, 40)
    assert calls
    # A steady series has no change point, so nothing is verified despite the claim.
    assert det.stats.verifications <= 1
    assert all(d.report is None or d.report.devices for d in out)


# ------------------------------------------------------------------ the healthy model
def test_model_fits_the_cost_and_predicts_without_a_plan() -> None:
    trace = Trace(seed=6)
    model = WorkloadModel(warmup_iterations=3)
    with pytest.raises(ModelNotReady):
        model.predict_healthy(0, trace.iteration(0))
    for it in range(3):
        model.add_warmup(trace.iteration(it, noise=0.0))
    assert model.ready and model.fit_error is None
    c = model.costs[(0, 0)]
    assert c.alpha_f == pytest.approx(ALPHA, rel=0.05) and c.beta_f == pytest.approx(BETA, rel=0.05)
    p = trace.iteration(10, noise=0.0)
    assert model.predict_healthy(10, p) == pytest.approx(measured_iteration_time(p), rel=0.02)
    r0 = p[0]
    assert model.rank_compute(r0) == pytest.approx(sum(m.forward_s + m.backward_s for m in r0.microbatches), rel=0.01)


def test_model_divides_known_speeds_out_of_the_warmup() -> None:
    trace = Trace(seed=7)
    trace.slow[0] = 2.0
    model = WorkloadModel(warmup_iterations=2, speeds={10: 0.5})
    for it in range(2):
        model.add_warmup(trace.iteration(it, noise=0.0))
    assert model.costs[(0, 0)].alpha_f == pytest.approx(ALPHA, rel=0.05)  # healthy cost
    p = trace.iteration(5, noise=0.0)
    meas = sum(m.forward_s + m.backward_s for m in p[0].microbatches)
    assert model.rank_compute(p[0]) == pytest.approx(meas, rel=0.02)  # slow device predicted slow


def test_model_never_fits_negative_costs() -> None:
    model = WorkloadModel(warmup_iterations=1)
    mbs = tuple(
        MicroBatchProfile(owner=0, mb=j, forward_s=f, backward_s=f, doc_lengths=lengths)
        for j, (lengths, f) in enumerate([((1024, 1024), 1.0), ((2000, 48), 0.1), ((512,) * 4, 5.0)])
    )
    model.add_warmup({0: IterationProfile(rank=0, device=0, generation=0, iteration=0, stage=0, replica=0,
                                          microbatches=mbs, comm_s=0.0, iteration_s=7.0)})
    c = model.costs[(0, 0)]
    assert min(c.alpha_f, c.beta_f, c.alpha_b, c.beta_b) >= 0


def test_model_with_a_plan_simulates_the_pipeline() -> None:
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=4)
    topo = Topology.uniform(1, 2)
    shape = ModelShape(tokens=N, hidden=64, params_per_layer=1000)
    model = WorkloadModel(plan=plan, topology=topo, shape=shape, warmup_iterations=2)
    rng = random.Random(0)
    pool = packed_microbatches(CorpusSpec(scale=300, token_budget=N), 64)

    def it_profiles(it: int) -> dict[int, IterationProfile]:
        work = [rng.choice(pool) for _ in range(4)]
        out = {}
        for s in range(2):
            mbs = tuple(MicroBatchProfile(owner=0, mb=j, forward_s=2 * (ALPHA * N + BETA * sum(l * l for l in w)),
                                          backward_s=4 * (ALPHA * N + BETA * sum(l * l for l in w)), doc_lengths=w)
                        for j, w in enumerate(work))
            out[s] = IterationProfile(rank=s, device=s, generation=0, iteration=it, stage=s, replica=0,
                                      microbatches=mbs, comm_s=0.01, iteration_s=0.2)
        return out

    for it in range(2):
        model.add_warmup(it_profiles(it))
    assert model.ready
    t = model.predict_healthy(5, it_profiles(5))
    assert t > 0
    # The simulator is used: its prediction differs from "slowest executor's compute".
    assert model._iteration_predictor() is not None
    assert model.fitted_predictor() is not None
    # A warm-up that never saw stage 1 (its ranks' profiles missing): the supervisor's
    # thread asks for the fitted predictor and gets None, not the model's ModelNotReady.
    model.reset(plan=plan)
    for it in range(2):
        model.add_warmup({0: it_profiles(it)[0]})
    assert model.ready and model.fitted_predictor() is None


# ------------------------------------------------------------------ verification
class FakeProber:
    def __init__(self, compute: dict[int, float] | None = None, links: dict[int, float] | None = None) -> None:
        self.compute, self.links, self.calls = compute or {}, links or {}, []

    def probe_compute(self, devices):
        self.calls.append(("compute", tuple(devices)))
        return ProbeResult({d: self.compute.get(d, 1.0) for d in devices}, reference=1.0, elapsed_s=0.5)

    def probe_links(self, devices):
        self.calls.append(("links", tuple(devices)))
        return ProbeResult({d: self.links.get(d, 1.0) for d in devices}, reference=1.0, elapsed_s=0.5)


def tp_profiles(slow_group: tuple[int, int] | None, factor: float, *, comm_extra: float = 0.0,
                per_rank: dict[int, float] | None = None, it: int = 0) -> dict[int, IterationProfile]:
    """2 replicas x 1 stage x TP 2: ranks 0,1 = replica 0; ranks 2,3 = replica 1."""
    out = {}
    lengths = (1024, 512, 512)
    for rank in range(4):
        rep = rank // 2
        f = factor if slow_group == (rep, 0) else 1.0
        f *= (per_rank or {}).get(rank, 1.0)
        t = ALPHA * 2048 + BETA * sum(l * l for l in lengths)
        mbs = tuple(MicroBatchProfile(owner=rep, mb=j, forward_s=t * f, backward_s=2 * t * f, doc_lengths=lengths)
                    for j in range(4))
        out[rank] = IterationProfile(rank=rank, device=rank, generation=0, iteration=it, stage=0, replica=rep,
                                     microbatches=mbs, comm_s=0.001 + comm_extra, iteration_s=0.0)
    total = max(sum(m.forward_s + m.backward_s for m in p.microbatches) + p.comm_s for p in out.values())
    return {r: IterationProfile(**{**{f: getattr(p, f) for f in p.__struct_fields__}, "iteration_s": total})
            for r, p in out.items()}


def fitted_model() -> WorkloadModel:
    m = WorkloadModel(warmup_iterations=2)
    m.add_warmup(tp_profiles(None, 1.0))
    m.add_warmup(tp_profiles(None, 1.0))
    assert m.ready
    return m


def verify(iterations, prober=None, model=None):
    from resihp_core.detector import VerificationContext

    return ProfileVerifier().verify(VerificationContext(0, iterations, model=model, prober=prober))


def test_verify_a_tp_group_uniformly_slow_needs_a_probe() -> None:
    model = fitted_model()
    slow = [tp_profiles((1, 0), 1.8, it=i) for i in range(2)]
    prober = FakeProber(compute={3: 1.8})
    v = verify(slow, prober, model)
    assert v.cause == "compute" and set(v.slow) == {3}
    assert v.slow[3] == pytest.approx(1 / 1.8, rel=0.02)
    assert prober.calls == [("compute", (2, 3))] and v.probe_rounds == 1
    # Without a prober: the whole group, said to be ambiguous.
    v = verify(slow, None, model)
    assert set(v.slow) == {2, 3} and "no prober" in v.evidence


def _chunks(profile: IterationProfile, scale: list[float]) -> IterationProfile:
    """``profile`` with its k-th chunk (micro-batch forward, backward, in order) scaled by
    ``scale[k]``."""
    mbs = tuple(MicroBatchProfile(owner=m.owner, mb=m.mb, forward_s=m.forward_s * scale[2 * j],
                                  backward_s=m.backward_s * scale[2 * j + 1], doc_lengths=m.doc_lengths)
                for j, m in enumerate(profile.microbatches))
    return IterationProfile(**{**{f: getattr(profile, f) for f in profile.__struct_fields__}, "microbatches": mbs})


def test_verify_a_tp_member_its_peer_waited_for_is_told_apart_chunk_by_chunk() -> None:
    """The fresh-clone CI run of test_chaos's TP member slowed 10x (issue #33): the
    injector sleeps after each of the member's chunks, and its TP peer waits for that
    sleep inside its next chunk's collectives, so over the iteration the peer computed
    about as long (7.07x against the member's 7.9x, within the 15 % that tells ranks
    apart) and both were reported. The peer's first chunk of each iteration, before it
    ever waits, ran at its own speed while the member's was 7.9x: only the member."""
    model = fitted_model()
    its = []
    for i in range(3):
        ps = tp_profiles(None, 1.0, it=i)
        member = [7.9] * 8
        peer = [1.0] + [0.99 * 7.9] * 7  # waiting inside every later chunk
        ps[3], ps[2] = _chunks(ps[3], member), _chunks(ps[2], peer)
        its.append(ps)
    q = {r: sum(m.forward_s + m.backward_s for m in its[0][r].microbatches) / model.rank_compute(its[0][r])
         for r in (2, 3)}
    assert q[3] < 1.15 * q[2], q  # alike over the iteration: the old split reported both
    v = verify(its, None, model)
    assert v.cause == "compute" and set(v.slow) == {3}, v
    # A member slowed inside each chunk's own collectives (its peer slowed alike in every
    # chunk): the profiles cannot split it, as before.
    alike = [tp_profiles((1, 0), 7.9, it=i) for i in range(3)]
    assert set(verify(alike, None, model).slow) == {2, 3}


def test_verify_ranks_that_differ_are_told_apart_without_probes() -> None:
    model = fitted_model()
    slow = [tp_profiles(None, 1.0, per_rank={1: 2.0}, it=i) for i in range(2)]
    prober = FakeProber()
    v = verify(slow, prober, model)
    assert set(v.slow) == {1} and v.cause == "compute" and prober.calls == []


def test_verify_tp_communication_shows_as_compute_until_probed() -> None:
    model = fitted_model()
    slow = [tp_profiles((0, 0), 1.6, it=i) for i in range(2)]
    prober = FakeProber(links={0: 4.0})
    v = verify(slow, prober, model)
    assert v.cause == "communication" and set(v.slow) == {0} and v.probe_rounds == 2


def test_verify_spread_communication_uses_a_link_probe() -> None:
    model = fitted_model()
    slow = [tp_profiles(None, 1.0, comm_extra=0.05, it=i) for i in range(2)]
    prober = FakeProber(links={2: 10.0})
    v = verify(slow, prober, model)
    assert v.cause == "communication" and set(v.slow) == {2} and v.slow[2] == pytest.approx(0.1, rel=0.02)
    assert prober.calls == [("links", (0, 1, 2, 3))]
    assert not verify(slow, FakeProber(), model).confirmed


def test_verify_does_not_blame_compute_noise_for_a_communication_slowdown() -> None:
    model = fitted_model()
    # rank 1 computes 1.3x (noise), but the iteration is slow by far more, outside compute
    slow = [tp_profiles(None, 1.0, per_rank={1: 1.3}, comm_extra=0.1, it=i) for i in range(2)]
    v = verify(slow, FakeProber(links={2: 10.0}), model)
    assert v.cause == "communication" and set(v.slow) == {2}
    # the same compute slowdown that does explain the iteration is still compute
    v = verify([tp_profiles(None, 1.0, per_rank={1: 1.3}, it=i) for i in range(2)], FakeProber(), model)
    assert v.cause == "compute" and set(v.slow) == {1}


def test_verify_a_ranks_waiting_for_contended_peers_is_not_its_link() -> None:
    from msgspec.structs import replace

    model = fitted_model()

    def blocked(it: int, peers_waited: float) -> dict[int, IterationProfile]:
        # rank 2 spends 0.1 s more outside compute; the others may have waited for a CPU
        out = tp_profiles(None, 1.0, it=it)
        return {r: replace(p, iteration_s=p.iteration_s + (0.1 if r == 2 else 0.0),
                           comm_s=p.comm_s + (0.1 if r == 2 else 0.0),
                           compute_wait_s=0.0 if r == 2 else peers_waited,
                           cpu_wait_s=0.0 if r == 2 else peers_waited) for r, p in out.items()}

    v = verify([blocked(i, 0.0) for i in range(2)], None, model)
    assert v.cause == "communication" and set(v.slow) == {2}, v
    # the same excess while its peers waited for CPUs other processes held: the machine
    v = verify([blocked(i, 0.08) for i in range(2)], FakeProber(links={2: 10.0}), model)
    assert not v.confirmed and "contended" in v.evidence, v


def test_verify_a_link_localised_by_profiles_holds_in_the_iterations_one_by_one() -> None:
    """Rank 2's time outside compute above the expected in every iteration verified: its
    link. The same excess in total, from one long wait in one of three iterations (a
    rank descheduled once on a loaded machine; benchmarks/false_reports.py recorded
    such a report): not a slow link, nothing reported without a prober, and a link
    probe decides with one (docs/detector.md "False reports on a loaded machine")."""
    from msgspec.structs import replace

    model = fitted_model()

    def late(it: int, extra: float) -> dict[int, IterationProfile]:
        out = tp_profiles(None, 1.0, it=it)
        return {r: replace(p, iteration_s=p.iteration_s + (extra if r == 2 else 0.0),
                           comm_s=p.comm_s + (extra if r == 2 else 0.0)) for r, p in out.items()}

    v = verify([late(i, 0.1) for i in range(3)], None, model)
    assert v.cause == "communication" and set(v.slow) == {2}, v
    once = [late(0, 0.3), late(1, 0.0), late(2, 0.0)]
    v = verify(once, None, model)
    assert not v.confirmed and "one by one" in v.evidence, v
    v = verify(once, FakeProber(), model)
    assert not v.confirmed and "link probe" in v.evidence, v
    v = verify(once, FakeProber(links={2: 3.0}), model)
    assert v.cause == "communication" and set(v.slow) == {2}, v


def test_verify_does_not_report_a_slowdown_every_device_shares() -> None:
    model = fitted_model()
    everyone = [tp_profiles(None, 1.0, per_rank={0: 1.5, 1: 1.55, 2: 1.5, 3: 1.45}, it=i) for i in range(2)]
    v = verify(everyone, FakeProber(), model)
    assert not v.confirmed and "machine-wide" in v.evidence
    # one replica clearly slower than the other is still a device matter
    v = verify([tp_profiles(None, 1.0, per_rank={0: 1.5, 1: 1.5, 2: 2.2, 3: 1.5}, it=i) for i in range(2)],
               FakeProber(), model)
    assert v.confirmed and 2 in v.slow


def test_greyhound_verifier_thresholds() -> None:
    from resihp_core.detector import VerificationContext

    its = [tp_profiles(None, 1.0)]
    g = GreyhoundVerifier()
    weak = g.verify(VerificationContext(0, its, prober=FakeProber(compute={1: 1.6})))
    assert not weak.confirmed  # 1.6x < 2x median: missed by design
    strong = g.verify(VerificationContext(0, its, prober=FakeProber(compute={1: 2.5})))
    assert strong.cause == "compute" and set(strong.slow) == {1}
    comm = g.verify(VerificationContext(0, its, prober=FakeProber(links={3: 1.2})))
    assert comm.cause == "communication" and set(comm.slow) == {3}
    assert comm.probe_rounds == 1 + 2  # compute probe + TP and DP link rounds


def test_probe_result_throughput() -> None:
    assert ProbeResult({1: 2.0, 2: 1.0}, reference=1.0).throughput() == {1: 0.5, 2: 1.0}
    assert ProbeResult({1: 2.0, 2: 1.0, 3: 1.0}).throughput()[1] == pytest.approx(0.5)


# ------------------------------------------------------------------ plugins and construction
def test_builtins_register_detectors_and_strategies() -> None:
    plugins = Plugins(autoload=False)
    assert {"bocpd", "cusum", "greyhound"} <= set(plugins.changepoint_detectors().names())
    assert {"resihp", "greyhound"} <= set(plugins.verification_strategies().names())


@pytest.mark.parametrize("method", ["bocpd", "cusum"])
def test_build_from_config(method: str) -> None:
    plugins = Plugins(autoload=False)
    det = build_failslow_detector(DetectorConfig(changepoint_method=method, slow_threshold=0.3), plugins=plugins)
    assert det.slow_threshold == 0.3 and det.min_gap == 10
    base = build_baseline_detector(plugins=plugins)
    assert isinstance(base.changepoint, GreyhoundChangePoint)


def test_a_plugin_detector_replaces_the_builtin() -> None:
    from resihp_core.hookspecs import hookimpl

    made = []

    class Mine:
        @hookimpl
        def resihp_register_changepoint_detectors(self, registry) -> None:
            def factory(**options):
                made.append(options)
                return BOCPD()

            registry.register("bocpd", factory)

    plugins = Plugins(autoload=False)
    plugins.register(Mine(), "mine")
    build_failslow_detector(DetectorConfig(), plugins=plugins)
    assert made == [{"threshold": 0.8, "hazard": 0.01}]


# ------------------------------------------------------------------ a device or its environment
class StagedTrace(Trace):
    """Four ranks as 2 replicas x 2 stages (TP 1)."""

    def iteration(self, it: int, noise: float = 0.02) -> dict[int, IterationProfile]:
        return {r: replace_profile(p, stage=r % 2, replica=r // 2) for r, p in super().iteration(it, noise).items()}


def replace_profile(p: IterationProfile, **kw) -> IterationProfile:
    import msgspec

    return msgspec.structs.replace(p, **kw)


def test_contention_of_one_device_is_a_localised_fail_slow_with_cause_contention() -> None:
    # Other processes holding one worker's CPU (its own run delay says so) slow that
    # device and not its peers: moving work away helps, so it is a fail-slow whatever
    # the cause, and the cause the evidence supports is named.
    trace = Trace(seed=5)
    trace.base_wait = 0.05
    det = resihp()
    assert not [d for d in feed(det, trace, 0, 40) if d.report is not None]
    trace.contended[2] = 1.8
    after = feed(det, trace, 40, 52)
    reported = [d for d in after if d.report is not None]
    assert len(reported) == 1, [d.action for d in after]
    rep = reported[0].report
    assert rep.devices == (12,) and rep.cause == "contention", rep
    assert reported[0].iteration - 40 + 1 <= 3
    assert rep.throughput[12] == pytest.approx(1 / 1.8, abs=0.06)  # what it delivers, waiting included
    assert "waiting for a CPU" in rep.evidence


def test_an_unpinned_rank_waiting_is_not_its_hosts_contention() -> None:
    """The fresh-clone CI report of test_deepspeed_failslow: an unpinned worker waiting
    1.35x its compute (the scheduler put it on a crowded core) as another device's real
    slowdown began was reported as contention and pre-empted the real report. A worker
    free to run on its peers' cores has no cores of its own to be contended
    (docs/detector.md "Pinned or unpinned"): the real slowdown is reported, the waiting
    rank never, not even over a whole unpinned window (12 iterations). A worker that
    does not report its CPUs is taken as unpinned (test_detector_rules.py)."""
    trace = Trace(seed=5)
    trace.base_wait = 0.05
    trace.affinity = "shared"
    det = resihp()
    assert not [d for d in feed(det, trace, 0, 40) if d.report is not None]
    trace.contended[0] = 1.35
    trace.slow[2] = 2.0
    after = feed(det, trace, 40, 58)
    reports = [d for d in after if d.report is not None]
    assert reports and reports[0].report.devices == (12,) and reports[0].report.cause == "compute", \
        [(d.iteration, d.action, d.verdict and d.verdict.evidence[:200]) for d in after]
    assert reports[0].iteration - 40 + 1 <= 3
    assert not [d for d in reports if 10 in d.report.devices], [d.report for d in reports]
    # Pinned, the same waiting is a hog on its own core: reported as contention.
    trace = Trace(seed=5)
    trace.base_wait = 0.05
    det = resihp()
    feed(det, trace, 0, 40)
    trace.contended[0] = 1.35
    after = feed(det, trace, 40, 46)
    reports = [d.report for d in after if d.report is not None]
    assert reports and reports[0].devices == (10,) and reports[0].cause == "contention", reports


def test_a_large_persistent_contention_of_an_unpinned_rank_is_reported_after_12_iterations() -> None:
    # 2x its peers in every iteration: not the scheduler's passing unevenness (a worker
    # in a CPU cgroup of lower weight looks like this).
    trace = Trace(seed=5)
    trace.base_wait = 0.05
    trace.affinity = "shared"
    det = resihp()
    feed(det, trace, 0, 40)
    trace.contended[1] = 2.0
    after = feed(det, trace, 40, 60)
    reports = [d for d in after if d.report is not None]
    assert reports and reports[0].report.devices == (11,) and reports[0].report.cause == "contention", \
        [(d.iteration, d.action) for d in after]
    assert 12 <= reports[0].iteration - 40 + 1 <= 14, reports[0].iteration


def test_contention_of_every_device_alike_is_machine_wide_and_not_reported() -> None:
    trace = Trace(seed=5)
    trace.base_wait = 0.05
    det = resihp()
    feed(det, trace, 0, 40)
    trace.contended.update({r: 1.8 for r in range(4)})
    after = feed(det, trace, 40, 60)
    assert not [d for d in after if d.report is not None], [d.action for d in after]
    cleared = [d for d in after if d.action == "cleared"]
    assert cleared and "machine-wide" in cleared[0].verdict.evidence, [d.action for d in after]


@pytest.mark.parametrize("others", [{}, {1: 1.6}], ids=["quiet", "another-rank-contended"])
def test_a_device_slowdown_is_still_found_within_three_iterations(others: dict[int, float]) -> None:
    # The wait taken out is the contention's only: a device slowdown (time off the CPU,
    # or on it) stays, also while another rank waits for a CPU at the same time.
    trace = Trace(seed=5)
    trace.base_wait = 0.05
    det = resihp()
    feed(det, trace, 0, 40)
    trace.slow[2] = 2.0
    trace.contended.update(others)
    after = feed(det, trace, 40, 50)
    reported = [d for d in after if d.report is not None]
    assert reported and reported[0].iteration - 40 + 1 <= 3, [d.action for d in after]
    # Another rank contended at the same time is localised too: reported beside it.
    assert reported[0].report.devices == tuple(sorted({12} | {10 + r for r in others}))
    assert reported[0].report.throughput[12] == pytest.approx(0.5, abs=0.06)


def test_a_device_slowdown_during_contention_of_the_same_rank_is_found() -> None:
    trace = Trace(seed=9)
    trace.base_wait = 0.05
    det = resihp()
    feed(det, trace, 0, 40)
    trace.slow[1], trace.contended[1] = 2.0, 1.4
    rep = [d for d in feed(det, trace, 40, 50) if d.report is not None]
    assert rep and rep[0].report.devices == (11,) and rep[0].iteration - 40 + 1 <= 3
    assert rep[0].report.throughput[11] == pytest.approx(0.5, abs=0.06)  # the device's own slowdown


def test_executors_slowing_more_than_their_peers_are_reported_every_executor_alike_is_not() -> None:
    trace = StagedTrace(seed=6)
    det = resihp()
    feed(det, trace, 0, 40)
    trace.slow.update({0: 2.0, 3: 1.9})  # replica 0 stage 0 and replica 1 stage 1: slower than their peers
    rep = [d for d in feed(det, trace, 40, 52) if d.report is not None]
    assert rep and rep[0].report.devices == (10, 13) and rep[0].iteration - 40 + 1 <= 3, rep
    # Every executor slowed alike: the machine, nothing to plan around.
    trace2 = StagedTrace(seed=6)
    det2 = resihp()
    feed(det2, trace2, 0, 40)
    trace2.slow.update({0: 2.0, 1: 1.95, 2: 2.0, 3: 1.9})
    after = feed(det2, trace2, 40, 52)
    assert not [d for d in after if d.report is not None], [d.action for d in after]
    assert any("machine-wide" in d.verdict.evidence for d in after if d.verdict is not None)
    # One device of the same layout is reported, within 3 iterations.
    trace3 = StagedTrace(seed=6)
    det3 = resihp()
    feed(det3, trace3, 0, 40)
    trace3.slow[3] = 2.0
    rep = [d for d in feed(det3, trace3, 40, 50) if d.report is not None]
    assert rep and rep[0].iteration <= 42 and rep[0].report.devices == (13,)


def test_a_slowdown_that_fades_within_its_verification_window_is_not_verified() -> None:
    trace = Trace(seed=7)
    det = resihp()
    feed(det, trace, 0, 40)
    trace.slow[1] = 2.5
    blip = feed(det, trace, 40, 42)  # two slow iterations ...
    trace.slow.clear()
    rest = feed(det, trace, 42, 60)  # ... and healthy again
    acts = [d.action for d in blip + rest]
    assert not [d for d in blip + rest if d.report is not None], acts
    assert "faded" in acts and det.stats.verifications == 0, acts


def test_environment_change_the_probe_and_the_run_delay() -> None:
    from resihp_core.detector.environment import (CpuWaitMeter, EnvironmentProbe, environment_change, is_running,
                                                  run_delay_s, runnable_tasks)

    before = [{1: 1.2, 2: 1.0}, {1: 1.4, 2: 0.0}]
    after = [{1: 2.6, 2: 2.0, 3: 5.0}]
    assert environment_change(before, after) == pytest.approx({1: 2.0, 2: 2.0})
    import subprocess
    import sys

    probe = EnvironmentProbe(interval_s=0.05)
    assert probe.level == 0.0
    assert probe.sample() >= 1.0 and probe.level >= 1.0
    # Busy processes outside the job raise the contention; the same processes counted as
    # the job's do not.
    code = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    burners = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2 * probe.cores)]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _t.sleep(0.5)
        # The process states and the machine's runnable count the probe reads.
        assert sum(is_running(b.pid) for b in burners) >= 1 and not is_running(sleeper.pid)
        assert runnable_tasks() >= 1  # this thread, reading, is one
        outside = EnvironmentProbe(reads=20).sample(_t.sleep)
        inside = EnvironmentProbe(job_pids=lambda: [b.pid for b in burners], reads=20).sample(_t.sleep)
        # This thread, busy among them, waits for a CPU (run delay) for a good part of
        # its wall time; asleep it does not (at most its wake-ups wait).
        meter = CpuWaitMeter()
        meter.start_iteration()
        meter.start_chunk()
        t0 = _t.perf_counter()
        while _t.perf_counter() - t0 < 0.4:
            pass
        meter.end_chunk()
        busy_wait = meter.compute_s
        meter.start_chunk()
        _t.sleep(0.3)
        meter.end_chunk()
        asleep_wait = meter.compute_s - busy_wait
    finally:
        for b in [*burners, sleeper]:
            b.kill()
            b.wait()
    assert outside > inside and outside >= 1.5, (outside, inside)
    assert run_delay_s() is not None
    assert busy_wait >= 0.1 and asleep_wait < 0.1, (busy_wait, asleep_wait)


def test_contention_that_moves_between_executors_is_machine_wide() -> None:
    # A loaded machine is not fair per process over short windows: one executor loses
    # much more than the others, but a different one each iteration. No executor is
    # slower than its peers in most iterations: nothing is reported.
    trace = StagedTrace(seed=8)
    trace.base_wait = 0.05
    det = resihp(min_gap=3)
    feed(det, trace, 0, 40)
    during = []
    for it in range(40, 64):
        trace.contended = {it % 4: 2.2, (it + 1) % 4: 1.3}
        during.append(det.observe(it, trace.iteration(it)))
    assert not [d for d in during if d.report], [(d.iteration, d.action) for d in during]
    trace.contended = {}
    trace.slow = {1: 2.6}  # calm again, and now device 11 itself is slow
    later = feed(det, trace, 64, 80)
    reported = [d for d in later if d.report]
    assert reported and reported[0].report.devices == (11,), [(d.iteration, d.action) for d in later]
    assert reported[0].report.cause == "compute"
    assert reported[0].iteration - 64 + 1 <= 3


def test_cpu_wait_meter_counts_only_the_compute_chunks() -> None:
    from resihp_core.detector.environment import CpuWaitMeter

    now = [0.0]
    m = CpuWaitMeter(clock=lambda: now[0])
    m.start_iteration()
    now[0] += 0.5  # waited before the first primitive
    m.start_chunk()
    now[0] += 0.2  # a compute chunk
    m.end_chunk()
    m.start_chunk()
    now[0] += 0.1  # a receive: not compute
    m.start_chunk()
    now[0] += 0.3  # a compute chunk
    m.end_chunk()
    assert m.compute_s == pytest.approx(0.5) and m.iteration_s() == pytest.approx(1.1)
    m.start_iteration()
    assert m.compute_s == 0.0 and m.iteration_s() == 0.0
    blind = CpuWaitMeter(clock=lambda: None)  # no scheduler statistics: nothing measured
    blind.start_iteration()
    blind.start_chunk()
    blind.end_chunk()
    assert blind.compute_s == 0.0 and blind.iteration_s() == 0.0


def test_adapter_steps_and_compute_ends_drive_the_workers_meter() -> None:
    from resihp_core.adapter import AdapterContext
    from resihp_core.runtime.worker.injector import FaultInjector

    now = [0.0]
    inj = FaultInjector(0, [{"device": 0, "iteration": 1, "kind": "slow", "factor": 1.5}])
    inj.cpu_wait.clock = lambda: now[0]
    ctx = AdapterContext(device=0, job=None, store=None, faults=inj)
    inj.at_iteration(1)
    now[0] += 1.0  # waited outside any primitive
    ctx.step(1, 0)  # a compute primitive starts ...
    now[0] += 0.25
    assert inj.stretch(0.01) == pytest.approx(0.015)  # ... and ends (then the injected sleep)
    ctx.step(1, 1)  # a receive: not compute
    now[0] += 0.5
    assert inj.cpu_wait.compute_s == pytest.approx(0.25) and inj.cpu_wait.iteration_s() == pytest.approx(1.75)


def test_contention_every_device_shares_unevenly_is_the_machine() -> None:
    # Busy processes on every core: every rank waits for a CPU, one more than the others
    # (1.22x them: the scheduler is not fair per process). Its peers' own waiting shows
    # the contention is the machine's: nothing is reported.
    trace = Trace(seed=11)
    trace.base_wait = 0.05
    det = resihp()
    feed(det, trace, 0, 40)
    trace.contended.update({0: 1.8, 1: 1.7, 2: 2.2, 3: 1.9})
    after = feed(det, trace, 40, 56)
    assert not [d for d in after if d.report is not None], [d.action for d in after]
    assert any("its peers share" in d.verdict.evidence for d in after if d.verdict is not None)


def test_contention_its_peers_do_not_share_on_a_loaded_machine_is_reported_within_3_iterations() -> None:
    # The same loaded machine, but one rank held to its own core loses 2.2x what its
    # peers lose in every iteration (a noisy neighbour on its core, issue #33): its
    # peers waiting too does not make it the machine's, and the loaded machine's
    # 6-iteration window does not apply to a paired ratio that high in every iteration.
    trace = Trace(seed=11)
    trace.base_wait = 0.05
    det = resihp()
    feed(det, trace, 0, 40)
    trace.contended.update({0: 1.8, 1: 1.7, 2: 4.0, 3: 1.9})
    after = feed(det, trace, 40, 56)
    reports = [d for d in after if d.report is not None]
    assert reports and reports[0].report.devices == (12,) and reports[0].report.cause == "contention", \
        [(d.iteration, d.action, d.verdict and d.verdict.rule) for d in after]
    assert reports[0].iteration - 40 + 1 <= 3, reports[0].iteration
    # Unpinned (free to run on its peers' cores), the same is where the scheduler put
    # it: not reported within 3.
    trace = Trace(seed=11)
    trace.base_wait = 0.05
    trace.affinity = "shared"
    det = resihp()
    feed(det, trace, 0, 40)
    trace.contended.update({0: 1.8, 1: 1.7, 2: 4.0, 3: 1.9})
    early = [d for d in feed(det, trace, 40, 43) if d.report is not None]
    assert not early, [d.report for d in early]


def test_contention_its_peers_do_not_share_right_after_a_machine_wide_burst_is_reported_within_3() -> None:
    # A loaded machine; every rank slowed alike for a few iterations (a burst of the
    # machine's load: verified and cleared, which holds the iteration-time path off for
    # ``min_gap`` iterations), then a noisy neighbour on rank 2's own core (issue #33).
    # The per-device path finds in its run what chance does not give (rank 2 waits
    # 76 % of its compute, 2.2x its peers in every iteration, the host's healthy history
    # never that high): verified within 3 iterations, not the loaded machine's 6.
    def run(**kw) -> list:
        trace = Trace(seed=11)
        trace.base_wait = 0.05
        det = resihp(**kw)
        feed(det, trace, 0, 36)
        trace.contended.update({0: 2.5, 1: 2.5, 2: 2.5, 3: 2.5})
        burst = feed(det, trace, 36, 40)
        assert [d for d in burst if d.action == "cleared"], [(d.iteration, d.action) for d in burst]
        trace.contended.update({0: 1.8, 1: 1.7, 2: 4.0, 3: 1.9})
        return feed(det, trace, 40, 50)

    after = run()
    reports = [d for d in after if d.report is not None]
    assert reports and reports[0].report.devices == (12,) and reports[0].report.cause == "contention", \
        [(d.iteration, d.action, d.verdict and d.verdict.rule) for d in after]
    assert reports[0].iteration - 40 + 1 <= 3, [(d.iteration, d.action, d.verdict and d.verdict.rule) for d in after]
    # Without that evidence (a neighbour share no run can reach), the loaded machine's 6.
    late = [d for d in run(neighbour_share=0.99) if d.report is not None]
    assert late and late[0].iteration - 40 + 1 > 3, [(d.iteration, d.action) for d in late]


def _hopping(trace: Trace, it: int, hit: int) -> dict[int, IterationProfile]:
    """A loaded machine whose load hops between ranks: every rank waits for a CPU
    (peers ~45 % of their compute), and in iteration ``it`` rank ``hit`` is held 2.2x as
    long as the others (the scheduler's luck, not its core's)."""
    trace.contended = {r: (4.0 if r == hit else 1.8) for r in range(trace.ranks)}
    return trace.iteration(it)


def test_on_a_loaded_machine_a_confined_rank_the_hopping_load_hits_3_times_in_a_row_is_not_reported() -> None:
    """Chance on a loaded machine: the rank the load hits changes every iteration, and
    rank 2 is hit 3 times in a row (2.2x its peers, waiting, confined: what a neighbour
    looks like for 3 iterations). The host's healthy history shows one rank in four that
    high: the run is what its chance gives, so it keeps the loaded machine's window and,
    once the load moves on, is not reported. Verifying such a run after 3 (the window
    shortened for every confined device, ``loaded_window=3``) reports it."""
    def run(**kw) -> list:
        trace = Trace(seed=5)
        trace.base_wait = 0.05
        det = resihp(**kw)
        # A clean warm-up (nobody hit: the healthy model), then the load hops in turn.
        out = [det.observe(it, _hopping(trace, it, hit=it % 4 if it >= 6 else -1)) for it in range(40)]
        assert not [d for d in out if d.report is not None], [d.report for d in out if d.report is not None]
        out = [det.observe(it, _hopping(trace, it, hit=2)) for it in range(40, 43)]
        out += [det.observe(it, _hopping(trace, it, hit=(it % 2 == 0) * 3)) for it in range(43, 60)]
        return [d for d in out if d.report is not None]

    assert run() == []
    shortened = run(loaded_window=3)
    assert shortened and shortened[0].report.devices == (12,), shortened


# Recorded by benchmarks/detector_external.py --trace on this 2-core machine (load average
# 12-57, other processes holding 1.4-1.8 cores): per iteration, worker 0's compute and its
# run delay in compute, then worker 1's (seconds); the synthetic busy workers of a DP-2 job.
NO_FAULT_1X = [  # no fault, one unpinned busy process per core added; both workers pinned
    (0.543, 0.387, 0.961, 0.803), (1.167, 1.014, 0.79, 0.651), (1.135, 0.983, 0.77, 0.613), (1.012, 0.863, 0.962, 0.812),
    (0.949, 0.802, 0.978, 0.835), (0.497, 0.346, 0.679, 0.527), (0.586, 0.438, 0.57, 0.419), (0.212, 0.065, 0.818, 0.669),
    (0.616, 0.472, 1.033, 0.884), (0.833, 0.682, 0.887, 0.737), (1.073, 0.925, 0.956, 0.804), (1.109, 0.976, 1.096, 0.95),
    (1.318, 1.165, 1.18, 1.027), (1.116, 1.006, 1.015, 0.863), (0.996, 0.856, 0.921, 0.769), (1.033, 0.881, 2.189, 2.04),
    (0.969, 0.827, 1.277, 1.125), (0.903, 0.762, 1.146, 0.993), (1.206, 1.087, 1.54, 1.387), (1.286, 1.185, 1.713, 1.56),
    (1.655, 1.503, 1.102, 0.961), (1.661, 1.551, 0.941, 0.798), (1.36, 1.205, 1.004, 0.852)]
WHOLE_MACHINE_2X = [  # three busy processes pinned to each worker's core from iteration 12, two
    # unpinned per core added throughout; both pinned
    (1.741, 1.582, 4.733, 4.578), (10.504, 10.347, 1.559, 1.408), (5.758, 6.847, 1.516, 1.363), (2.608, 2.454, 2.976, 2.871),
    (2.161, 1.995, 4.79, 4.639), (2.558, 2.407, 6.769, 6.615), (1.507, 1.372, 2.306, 2.149), (0.919, 0.777, 1.083, 0.934),
    (0.851, 0.705, 1.106, 0.957), (1.22, 1.068, 0.78, 0.643), (0.847, 0.71, 6.231, 6.109), (1.231, 1.114, 0.888, 0.737),
    (2.148, 1.995, 0.795, 0.646), (5.416, 5.258, 0.967, 0.815), (1.954, 1.918, 0.854, 0.707), (2.24, 2.078, 3.927, 3.774),
    (2.912, 2.757, 4.062, 3.91), (9.925, 9.821, 8.149, 7.994), (10.274, 10.119, 9.032, 9.036), (2.708, 2.555, 6.391, 6.248),
    (1.791, 1.635, 7.825, 7.681), (1.699, 1.547, 1.763, 1.61), (1.608, 1.481, 1.659, 1.506)]
NO_FAULT_2X = [  # no fault, two unpinned busy processes per core added; both pinned
    (1.265, 1.112, 3.331, 3.196), (1.499, 1.345, 1.113, 0.989), (1.621, 1.45, 1.137, 0.976), (1.567, 1.412, 1.376, 1.235),
    (1.442, 1.28, 1.09, 0.934), (1.832, 1.684, 1.391, 1.233), (1.608, 1.454, 1.91, 1.752), (1.719, 1.568, 2.36, 2.222),
    (1.586, 1.431, 4.989, 4.822), (1.983, 1.826, 2.125, 1.961), (2.476, 2.334, 1.578, 1.424), (3.735, 3.581, 27.888, 27.747),
    (1.734, 1.581, 10.945, 11.319), (2.025, 1.882, 3.822, 3.683), (26.723, 26.566, 2.093, 2.057), (15.211, 15.053, 2.241, 2.146),
    (1.952, 1.793, 2.6, 2.446), (2.746, 2.625, 1.524, 1.368), (2.517, 2.362, 1.572, 1.417), (1.025, 0.896, 1.725, 1.571),
    (1.891, 1.733, 1.633, 1.546), (1.577, 1.427, 2.388, 2.23), (1.799, 1.63, 1.536, 1.393)]
NEIGHBOUR_0X = [  # worker 0 pinned to a core with three busy loops, worker 1 unpinned
    (1.134, 0.98, 1.314, 1.158), (1.585, 1.439, 2.716, 2.502), (1.469, 1.327, 2.941, 2.578), (1.412, 1.262, 2.129, 1.951),
    (1.157, 1.006, 2.129, 1.976), (1.311, 1.16, 1.974, 1.822), (1.55, 1.474, 1.373, 1.225), (1.4, 1.25, 2.373, 2.178),
    (1.172, 1.023, 1.971, 1.753), (0.999, 0.85, 1.413, 1.26), (0.791, 0.641, 2.047, 1.892), (1.002, 0.853, 4.777, 4.469),
    (0.868, 0.717, 4.246, 4.126), (1.016, 0.889, 2.91, 2.764), (1.941, 1.818, 3.228, 3.061), (1.38, 1.23, 2.424, 2.207),
    (8.07, 7.915, 2.138, 1.979), (6.126, 5.973, 2.828, 2.674), (4.113, 3.959, 1.977, 1.777), (1.523, 1.383, 1.645, 1.423),
    (1.66, 1.509, 0.853, 0.699), (3.184, 3.02, 0.942, 0.799), (2.119, 1.959, 0.93, 0.775)]


def _replay(rows: list[tuple[float, float, float, float]], unpinned: tuple[int, ...] = (),
            verifier: ProfileVerifier | None = None, **kw) -> list:
    """Reports of a detector (default, but for ``kw``) fed ``rows`` (above) as two DP
    replicas' profiles."""
    det = WorkloadAwareDetector(BOCPD(), verifier or ProfileVerifier(), **kw)
    out = []
    for it, row in enumerate(rows):
        total = max(row[0], row[2]) + 0.002
        ps = {r: IterationProfile(rank=r, device=r, generation=0, iteration=it, stage=0, replica=r,
                                  microbatches=(MicroBatchProfile(owner=r, mb=0, forward_s=row[2 * r] / 3,
                                                                  backward_s=2 * row[2 * r] / 3, doc_lengths=(256,)),),
                                  comm_s=total - row[2 * r], iteration_s=total, cpu_wait_s=row[2 * r + 1] * 1.02,
                                  compute_wait_s=row[2 * r + 1], cpus=(0, 1) if r in unpinned else (r,))
              for r in (0, 1)}
        d = det.observe(it, ps)
        if d.report is not None and d.action == "reported":
            out.append((it, d.report.devices, d.report.cause))
    return out


def test_recorded_runs_on_a_loaded_host_chance_is_not_reported_a_neighbour_is_within_3() -> None:
    """Recorded profiles of a loaded host (above). No fault at 1x: worker 1 runs 1.3-2.1x
    its peer for 5 iterations by chance, right after an earlier run of it was judged and
    cleared (its history restarted with 5 values): not reported. Whole-machine load at 2x:
    verifying a confined worker after 3 iterations on a loaded machine whatever its run
    (``loaded_window=3``) reported it. No fault at 2x: a stall of worker 1 (28 s, 11 s,
    then 3.8 s against its peer's 2-4 s) passed the paired bar in 3 iterations and was
    reported; its ratios swing 4x, not a neighbour's steady share (``unshared_spread``).
    The neighbour: worker 0 8x its peer from iteration 16, reported at 18 (within 3) as
    contention, where the loaded machine's 6 iterations (the evidence made unreachable)
    found nothing."""
    assert _replay(NO_FAULT_1X) == []
    assert _replay(WHOLE_MACHINE_2X) == []
    assert _replay(WHOLE_MACHINE_2X, loaded_window=3) != []
    assert _replay(NO_FAULT_2X) == []
    assert _replay(NO_FAULT_2X, verifier=ProfileVerifier(unshared_spread=100.0)) != []
    found = _replay(NEIGHBOUR_0X, unpinned=(1,))
    assert found and found[0][1:] == ((0,), "contention") and found[0][0] - 16 + 1 <= 3, found
    assert _replay(NEIGHBOUR_0X, unpinned=(1,), neighbour_share=0.99) == []


def test_a_job_whose_iterations_are_too_noisy_for_a_1_3x_slowdown_is_told_so_once() -> None:
    # Steady iterations: the per-device bar is the 1.25x floor, nothing to say.
    det = resihp()
    quiet = [d.notice for d in feed(det, Trace(seed=3), 0, 30) if d.notice]
    assert quiet == []
    # Compute that swings 25 % from one iteration to the next (short iterations on a
    # busy host): the user is told once which slowdowns are not found, with the bar.
    det = resihp()
    trace = Trace(seed=3)
    said = [d for d in (det.observe(it, trace.iteration(it, noise=0.25)) for it in range(30)) if d.notice]
    assert len(said) == 1, [d.notice for d in said]
    bar = float(said[0].notice.split("slowdowns under ")[1].split("x")[0])
    assert 1.3 < bar <= 2.0, said[0].notice  # above the target, at most the watch's cap
