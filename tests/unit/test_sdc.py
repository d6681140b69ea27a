"""Silent data corruption (docs/sdc.md): fingerprints, the comparison the last executor
runs before its verdict, the arbiter's decisions and the supervisor acting on them."""

from __future__ import annotations

import pytest
import torch

from resihp_core.detector.sdc import (
    Fingerprint, Quarantine, RangeWatch, Reexecute, Refuse, SdcArbiter, SdcDetected, SdcFinding, SdcGuard, SdcMonitor, SdcSuspect,
    SdcView, commit_check, compare, grad_norm, tensor_digest,
)
from resihp_core.runtime import session
from resihp_core.runtime.store import StoreServer
from resihp_core.runtime.controller.supervisor import Emit, Fail, Kill, NotifyFailure, PlanFailure, Retry

from test_supervisor import DEVICES, of, running, tick  # the same job and clock


def _state(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("w", torch.randn(7, 5, generator=g, dtype=torch.float64)),
            ("b", torch.randn(5, generator=g, dtype=torch.float32)), ("e", torch.zeros(0))]


@pytest.mark.parametrize("name,bit", [("w", 0), ("w", 33), ("w", 63), ("b", 0), ("b", 31)])
def test_one_flipped_bit_changes_the_digest_and_equal_bits_agree(name: str, bit: int) -> None:
    a, b = _state(), _state()
    assert tensor_digest(a) == tensor_digest(b)
    t = dict(b)[name]
    ints = t.view(torch.int64 if t.element_size() == 8 else torch.int32).view(-1)
    ints[3:4].bitwise_xor_((1 << bit) - (1 << 64 if bit == 63 else 0) - (1 << 32 if bit == 31 else 0))
    assert tensor_digest(a) != tensor_digest(b)


def test_the_digest_does_not_depend_on_how_a_tensor_is_laid_out() -> None:
    w = _state()[0][1]
    assert tensor_digest([("w", w)]) == tensor_digest([("w", w.t().contiguous().t())])
    # The same float32 values at an offset that is not a whole 64-bit word (an odd
    # count: a whole-word body and an element after it).
    x = torch.randn(9, dtype=torch.float32)
    buf = torch.zeros(10, dtype=torch.float32)
    buf[1:].copy_(x)
    assert tensor_digest([("x", x)]) == tensor_digest([("x", buf[1:])])
    buf[1:2].view(torch.int32).bitwise_xor_(1)
    assert tensor_digest([("x", x)]) != tensor_digest([("x", buf[1:])])


def _big(seed: int = 0) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Parameters and two optimizer-state tensors large enough to be read in windows."""
    from resihp_core.detector.sdc import MIN_WINDOW

    g = torch.Generator().manual_seed(seed)
    n = 4 * MIN_WINDOW  # float32: windows of n / 4 elements at share 0.25 or 4 rounds
    return ([("p", torch.randn(n, generator=g))],
            [("m", torch.randn(n, generator=g)), ("v", torch.randn(n, generator=g))])


def _flip(t: torch.Tensor, at: int) -> None:
    t.view(-1)[at:at + 1].view(torch.int32).bitwise_xor_(1 << 5)


def test_a_partial_fingerprint_reads_a_rotating_window_the_replicas_share() -> None:
    from resihp_core.detector.sdc import coverage

    (a, _), (b, _) = _big(), _big()
    n = a[0][1].numel()
    _flip(b[0][1], n - 1)  # in the last quarter
    turns = [tensor_digest(a, share=0.25, turn=t) != tensor_digest(b, share=0.25, turn=t) for t in range(8)]
    assert turns == [False, False, False, True] * 2
    assert tensor_digest(a, share=0.25, turn=1) == tensor_digest(_big()[0], share=0.25, turn=1)
    assert coverage({}) == 1.0 and coverage({"RESIHP_SDC_COVERAGE": "0.1"}) == 0.1
    with pytest.raises(ValueError, match="RESIHP_SDC_COVERAGE='0'"):
        coverage({"RESIHP_SDC_COVERAGE": "0"})


@pytest.mark.parametrize("rounds", [1, 4])
def test_parameters_are_read_whole_and_the_state_once_in_any_rounds_turns(rounds: int) -> None:
    """By default a fingerprint reads every parameter (a flip in one is found in its
    iteration) and a 1/rounds window of each optimizer-state tensor, staggered by
    tensor: a flip in the state is found in exactly one of any ``rounds`` consecutive
    turns, the same turns on every replica."""
    from resihp_core.detector.sdc import state_rounds, windows

    def differs(flip: str, at: int) -> list[bool]:
        (pa, sa), (pb, sb) = _big(), _big()
        _flip(dict(pb + sb)[flip], at)
        return [tensor_digest(pa, turn=t, state=sa, rounds=rounds) != tensor_digest(pb, turn=t, state=sb, rounds=rounds)
                for t in range(3, 3 + 2 * rounds)]

    n = _big()[0][0][1].numel()
    assert differs("p", n // 2) == [True] * (2 * rounds)
    for name, j in (("m", 0), ("v", 1)):
        for at in (0, n // 2, n - 1):
            got = differs(name, at)
            seen = [t for t, d in zip(range(3, 3 + 2 * rounds), got) if d]
            assert len(seen) == 2 and seen[1] - seen[0] == rounds, (name, at, got)
            assert (seen[0] + j) % rounds == at * rounds // n  # part (turn + j) of the tensor's rounds parts
    # A small state tensor (one window) is read in one turn out of ``rounds``; a tensor
    # passed twice (the same memory) is read once and named as an alias.
    (p, st), small = _big(), torch.ones(5)
    flipped = small.clone()
    _flip(flipped, 4)
    got = [tensor_digest(p, turn=t, state=st + [("s", small)], rounds=rounds) !=
           tensor_digest(p, turn=t, state=st + [("s", flipped)], rounds=rounds) for t in range(rounds)]
    assert got == [t == (-len(st)) % rounds for t in range(rounds)]  # part (t + 2) % rounds == 0
    for t in range(rounds):
        assert tensor_digest(p + [("q", p[0][1])], turn=t, state=st, rounds=rounds) != \
            tensor_digest(p + [("q", p[0][1].clone())], turn=t, state=st, rounds=rounds)
    assert state_rounds({}) == 8 and state_rounds({"RESIHP_SDC_STATE_ROUNDS": "3"}) == 3
    # partial coverage of the parameters never reads the state faster than them
    assert windows({}) == (1.0, 8) and windows({"RESIHP_SDC_COVERAGE": "0.1"}) == (0.1, 10)
    with pytest.raises(ValueError, match="RESIHP_SDC_STATE_ROUNDS='0'"):
        state_rounds({"RESIHP_SDC_STATE_ROUNDS": "0"})


def test_a_fingerprint_read_during_the_snapshot_copy_equals_a_separate_pass(monkeypatch) -> None:
    """``copy_with_sums`` copies every source exactly and its sums give the digest
    ``tensor_digest`` gives, whatever the pieces: dtypes with and without whole 64-bit
    words, a view starting off a word boundary, windows of the state, an aliased tensor,
    a window of a tensor that is not copied, and pieces small enough to cut windows."""
    import resihp_core.detector.sdc as sdc

    gen = torch.Generator().manual_seed(3)
    base32 = torch.randn(1001, generator=gen)
    params = [("a", torch.randn(300, 70, dtype=torch.float64, generator=gen)), ("b", base32[1:]),
              ("c", torch.randn(7, generator=gen).to(torch.bfloat16)), ("d", torch.randn(65_536 * 3 + 5, generator=gen))]
    state = [(f"m.{n}", t.clone() + 1) for n, t in params] + [("m.a2", params[0][1])]
    outside = ("e", torch.randn(50_000, generator=gen))  # fingerprinted, not part of the copy
    srcs = [t for _, t in params + state[:-1]]
    for piece, fuse_from in ((1 << 20, 1 << 20), (4096, 0), (20, 0), (20, 1 << 16)):
        monkeypatch.setattr(sdc, "COPY_PIECE_BYTES", piece)
        monkeypatch.setattr(sdc, "FUSE_MIN_BYTES", fuse_from)
        for turn in range(3):
            named = params + [outside]
            want = tensor_digest(named, turn=turn, state=state, rounds=3)
            labels, views = sdc.digest_windows(named, turn=turn, state=state, rounds=3)
            dsts = [torch.full_like(t, -1) for t in srcs]
            got = sdc.seal(labels, sdc.copy_with_sums(dsts, srcs, views))
            assert got == want, (piece, turn)
            assert all(torch.equal(d, t) for d, t in zip(dsts, srcs))
    # a flipped bit in the copy's source changes the digest read during the copy
    monkeypatch.setattr(sdc, "FUSE_MIN_BYTES", 0)
    labels, views = sdc.digest_windows(params, turn=0)
    before = sdc.seal(labels, sdc.copy_with_sums([t.clone() for t in srcs], srcs, views))
    _flip(params[3][1], 70_000)
    assert sdc.seal(labels, sdc.copy_with_sums([t.clone() for t in srcs], srcs, views)) != before


def _fps(digests: dict[int, str], group: str = "stage0") -> dict[int, Fingerprint]:
    return {d: Fingerprint(group, v) for d, v in digests.items()}


def test_three_replicas_outvote_the_odd_one() -> None:
    f = compare({**_fps({0: "a", 1: "x", 2: "a"}), 3: Fingerprint("stage1", "z")}, generation=4, iteration=7)
    assert f is not None and f.suspects == (1,) and f.candidates == () and f.groups == {"stage0": {0: "a", 1: "x", 2: "a"}}
    assert "iteration 7" in f.evidence and SdcFinding.from_json(f.to_json()) == f


def test_two_replicas_or_a_tie_give_candidates_only_and_agreement_nothing() -> None:
    f = compare(_fps({0: "a", 1: "b"}), generation=0, iteration=1)
    assert f is not None and f.suspects == () and f.candidates == (0, 1)
    f = compare(_fps({0: "a", 1: "b", 2: "a", 3: "b"}), generation=0, iteration=1)
    assert f is not None and f.suspects == () and f.candidates == (0, 1, 2, 3)
    assert compare({**_fps({0: "a", 1: "a"}), 2: Fingerprint("other", "b")}, generation=0, iteration=1) is None


@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", "s3cret")
    yield server.local(5.0)
    server.close()


def test_the_last_executor_aborts_a_disagreeing_iteration_and_leaves_the_finding(store) -> None:
    for d, v in ((0, "a"), (1, "a"), (2, "x")):
        session.put_fingerprint(store, 3, 5, d, Fingerprint("stage0", v).to_json())
    assert session.commit(store, 3, 5, 1, check=commit_check(store, 3, 5, [0, 1, 2])) == "abort"
    assert session.verdict(store, 3, 5) == "abort"
    f = SdcFinding.from_json(session.get_sdc_finding(store, 3, 5))
    assert f.suspects == (2,) and (f.generation, f.iteration) == (3, 5)
    # Agreement commits; a device that posted nothing (a standby) is not compared.
    for d in (0, 1):
        session.put_fingerprint(store, 3, 6, d, Fingerprint("stage0", "a").to_json())
    assert session.commit(store, 3, 6, 1, check=commit_check(store, 3, 6, [0, 1, 2])) == "commit"
    assert session.get_sdc_finding(store, 3, 6) is None


def test_a_malformed_fingerprint_is_skipped_not_taken_for_corruption(store, capsys) -> None:
    session.put_fingerprint(store, 1, 0, 0, Fingerprint("stage0", "a").to_json())
    session.put_fingerprint(store, 1, 0, 1, "{not json")
    assert session.commit(store, 1, 0, 1, check=commit_check(store, 1, 0, [0, 1])) == "commit"
    assert "event=sdc_check_skipped" in capsys.readouterr().out


def test_the_monitor_hands_on_each_finding_once_and_plugin_suspects(store) -> None:
    class Counter:
        def poll(self, view: SdcView) -> list[SdcSuspect]:
            return [SdcSuspect(device=view.devices[-1], iteration=view.committed, evidence="ECC count rose")]

    job = session.JobSession(store)
    from resihp_core.plan import ParallelPlan

    job.post(ParallelPlan.uniform(tp=1, pp=1, dp=3, num_layers=2, num_microbatches=1), devices=(0, 1, 2),
             iterations=9, resume=0)
    clock = [0.0]
    mon = SdcMonitor({"counter": Counter()}, clock=lambda: clock[0])
    got = mon.poll(job)
    assert [(e.finding.source, e.finding.suspects) for e in got] == [("counter", (2,))]
    session.put_sdc_finding(store, 0, 0, compare(_fps({0: "a", 1: "a", 2: "b"}), generation=0, iteration=0).to_json())
    session.abort_generation(store, 0, 0)
    assert mon.poll(job) == []  # within its interval
    clock[0] = 1.0
    got = mon.poll(job)
    assert [(e.finding.source, e.finding.suspects) for e in got] == [("fingerprint", (2,))]
    clock[0] = 2.0
    assert mon.poll(job) == []


def test_the_arbiter_quarantines_suspects_reexecutes_ties_and_refuses_a_persistent_tie() -> None:
    arb = SdcArbiter()
    q = arb.decide(SdcFinding(0, 4, suspects=(2,), evidence="x"))
    assert isinstance(q, Quarantine) and q.report.cause == "sdc" and q.report.devices == (2,)
    assert q.report.failure == "fail-stop"
    r = arb.decide(SdcFinding(0, 4, candidates=(0, 1)))
    assert isinstance(r, Reexecute) and r.candidates == (0, 1)
    assert "transient" in (arb.committed(4) or "") and arb.committed(4) is None
    assert isinstance(arb.decide(SdcFinding(1, 5, candidates=(0, 1))), Reexecute)
    refuse = arb.decide(SdcFinding(2, 5, candidates=(0, 1)))
    assert isinstance(refuse, Refuse) and "[0, 1]" in refuse.text and "cannot tell" in refuse.text


def test_the_supervisor_quarantines_a_suspect_as_a_fail_stop_with_cause_sdc() -> None:
    sup = running()
    acts = sup.handle(SdcDetected(SdcFinding(0, 1, suspects=(3,), evidence="disagree")))
    assert [a.kind for a in of(acts, Emit)] == ["sdc"] and not of(acts, PlanFailure)
    acts = sup.handle(tick())
    (note,) = of(acts, NotifyFailure)
    assert note.report.devices == (3,) and note.report.cause == "sdc"
    assert of(acts, Kill) == [Kill(3)] and of(acts, PlanFailure) and 3 in sup.handled


def test_the_supervisor_reexecutes_a_tie_and_reports_a_transient_flip() -> None:
    from resihp_core.runtime.controller.supervisor import Committed, Deployed

    sup = running()
    sup.handle(SdcDetected(SdcFinding(0, 1, candidates=(0, 2))))
    acts = sup.handle(tick())
    (retry,) = of(acts, Retry)
    assert "re-executing" in retry.why and not of(acts, Kill) and not sup.handled
    sup.handle(Deployed(1, DEVICES, 1))
    acts = sup.handle(Committed(1, 1))
    assert any("transient" in e.text for e in of(acts, Emit)) and not sup.handled
    # The same tie again after a re-execution: the job stops, naming the devices.
    sup.handle(SdcDetected(SdcFinding(1, 2, candidates=(0, 2))))
    sup.handle(tick())
    acts = sup.handle(SdcDetected(SdcFinding(2, 2, candidates=(0, 2))))
    assert of(acts, Fail) and "[0, 2]" in of(acts, Fail)[0].message


def test_a_guard_exists_only_for_an_adapter_that_declares_fingerprints() -> None:
    from resihp_core.adapter import Capabilities

    class Plain:
        capabilities = Capabilities()

    class Declares:
        capabilities = Capabilities(sdc_fingerprint=True)

        def fingerprint(self) -> Fingerprint:
            return Fingerprint("g", "d")

    class Liar:
        name = "liar"
        capabilities = Capabilities(sdc_fingerprint=True)

    assert SdcGuard.for_adapter(Plain(), 0) is None
    assert SdcGuard.for_adapter(Declares(), 0) is not None
    assert SdcGuard.for_adapter(Declares(), 0, env={"RESIHP_SDC": "0"}) is None
    with pytest.raises(TypeError, match="'liar' declares sdc_fingerprint"):
        SdcGuard.for_adapter(Liar(), 0)


def test_a_plugin_registers_an_sdc_detector_the_monitor_runs(monkeypatch) -> None:
    from resihp_core.hookspecs import hookimpl
    from resihp_core.plugins import FactoryRegistry, Plugins

    class Health:
        def poll(self, view: SdcView) -> list[SdcSuspect]:
            return []

    class Vendor:
        @hookimpl
        def resihp_register_sdc_detectors(self, registry: FactoryRegistry) -> None:
            registry.register("vendor-health", Health)

    plugins = Plugins(autoload=False, builtins=[])
    plugins.register(Vendor(), name="vendor")
    assert plugins.sdc_detectors().names() == ["vendor-health"]
    monkeypatch.setattr("resihp_core.plugins.Plugins", lambda: plugins)
    mon = SdcMonitor.from_plugins()
    assert isinstance(mon.detectors["vendor-health"], Health)


def test_the_range_watch_flags_a_jump_far_outside_recent_values_and_not_training_noise() -> None:
    w = RangeWatch(window=8, warmup=4, factor=100.0, sigmas=8.0)
    assert w.judge({"grad_norm": 1e30}) == ""  # no history yet: nothing to judge against
    assert "not finite" in w.judge({"grad_norm": float("inf")})  # judged from the first iteration
    for x in (1.0, 0.6, 1.4, 0.9, 1.1):
        w.commit({"grad_norm": x})
    assert w.judge({"grad_norm": 20.0}) == "" and w.judge({"grad_norm": 1e-6}) == ""  # noise, a drop
    why = w.judge({"grad_norm": 1e6, "loss": 2.0})
    assert why.startswith("grad_norm 1e+06 is") and "loss" not in why
    w.commit({"grad_norm": float("nan")})  # never taken into the history
    assert "not finite" in w.judge({"grad_norm": float("nan")})
    with pytest.raises(ValueError, match="warmup"):
        RangeWatch(warmup=1)


def test_grad_norm_matches_the_norm_of_the_concatenated_gradients() -> None:
    gs = [torch.randn(5, dtype=torch.float64), None, torch.randn(3, 2, dtype=torch.float64)]
    want = float(torch.cat([gs[0], gs[2].view(-1)]).norm())
    assert abs(grad_norm(gs) - want) <= 1e-12 * want and grad_norm([]) == 0.0


def _signals(anomalies: dict[int, str]) -> dict[int, Fingerprint]:
    return {d: Fingerprint("", "", {"grad_norm": 1.0}, why) for d, why in anomalies.items()}


def test_a_device_alone_out_of_range_is_a_finding_and_a_shared_jump_is_not(store) -> None:
    f = compare(_signals({0: "", 1: "grad_norm 1e30", 2: ""}), generation=0, iteration=3)
    assert f is not None and f.source == "range" and f.candidates == (1,) and f.suspects == ()
    assert compare(_signals({0: "x"}), generation=0, iteration=3).candidates == (0,)  # one device (DP = 1)
    assert compare(_signals({0: "x", 1: "y"}), generation=0, iteration=3) is None  # the data, not a device
    assert compare(_signals({0: "x", 1: "y", 2: ""}), generation=0, iteration=3) is None
    # A replica disagreement wins over the range signals (it names a suspect at once).
    fps = {**_signals({0: "", 1: "x", 2: ""}), **_fps({3: "a", 4: "a", 5: "b"})}
    assert compare(fps, generation=0, iteration=3).suspects == (5,)
    # Through the commit: the iteration aborts, the finding names the device.
    for d, fp in _signals({0: "", 1: "grad_norm 1e30", 2: "", 3: ""}).items():
        session.put_fingerprint(store, 1, 2, d, fp.to_json())
    assert session.commit(store, 1, 2, 1, check=commit_check(store, 1, 2, [0, 1, 2, 3])) == "abort"
    assert SdcFinding.from_json(session.get_sdc_finding(store, 1, 2)).candidates == (1,)


def test_the_guard_posts_signals_without_a_replica_and_learns_only_committed_iterations(store) -> None:
    from resihp_core.adapter import Capabilities

    class Solo:  # no replica shares its state: fingerprint() is None
        capabilities = Capabilities(sdc_fingerprint=True)
        norm = 1.0

        def fingerprint(self) -> None:
            return None

        def sdc_signals(self) -> dict[str, float]:
            return {"grad_norm": self.norm}

    a = Solo()
    guard = SdcGuard.for_adapter(a, 7)

    def post(g: int, i: int, **kw) -> None:  # what the worker's commit sets before its add
        text = guard.prepare(i, **kw)
        assert text is not None
        session.put_fingerprint(store, g, i, 7, text)

    for i in range(5):
        post(0, i, loss=2.0)
    a.norm = 1e9
    post(0, 5)
    got = Fingerprint.from_json(session.get_fingerprints(store, 0, 5, [7])[7])
    assert got.group == "" and got.signals == {"grad_norm": 1e9} and got.anomaly.startswith("grad_norm 1e+09")
    post(0, 5)  # the re-execution: the aborted value was not learnt
    assert Fingerprint.from_json(session.get_fingerprints(store, 0, 5, [7])[7]).anomaly
    # A new layout restarts the history (a retry of the same layout keeps it).
    from resihp_core.plan import ParallelPlan

    one = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=2, num_microbatches=2, num_heads=4)
    post(1, 5, plan=one)
    assert Fingerprint.from_json(session.get_fingerprints(store, 1, 5, [7])[7]).anomaly == ""
    a.norm = 1.0
    for i in range(5, 10):
        post(1, i, plan=one)
    a.norm = 1e9
    post(2, 10, plan=one.with_(generation=1))
    assert Fingerprint.from_json(session.get_fingerprints(store, 2, 10, [7])[7]).anomaly


def test_the_arbiter_quarantines_a_device_out_of_range_again_on_re_execution() -> None:
    arb = SdcArbiter()
    r = arb.decide(SdcFinding(0, 4, candidates=(1,), source="range", evidence="grad_norm"))
    assert isinstance(r, Reexecute) and "out of range" in r.text
    q = arb.decide(SdcFinding(1, 4, candidates=(1,), source="range"))
    assert isinstance(q, Quarantine) and q.report.devices == (1,) and q.report.cause == "sdc"
    assert arb.committed(4) is None  # iteration 4 committing on the survivors is no transient
    assert isinstance(arb.decide(SdcFinding(2, 6, candidates=(1,), source="range")), Reexecute)
    assert "transient" in (arb.committed(6) or "")  # the re-execution within range commits
