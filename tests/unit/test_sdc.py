"""Silent data corruption (docs/sdc.md): fingerprints, the comparison the last executor
runs before its verdict, the arbiter's decisions and the supervisor acting on them."""

from __future__ import annotations

import pytest
import torch

from resihp_core.detector.sdc import (
    Fingerprint, Quarantine, Reexecute, Refuse, SdcArbiter, SdcDetected, SdcFinding, SdcGuard, SdcMonitor, SdcSuspect,
    SdcView, commit_check, compare, tensor_digest,
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
