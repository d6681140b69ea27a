"""Fault scenarios: one API, clear errors naming the entry, repairs kept for the runtime."""

from __future__ import annotations

import json

import pytest

from resihp_core.faults import FaultError, fail_at, load_scenario, repairs, severity_factor, worker_faults


def test_severities_are_the_loss_they_cause() -> None:
    for sev, loss in (("weak", 0.35), ("medium", 0.55), ("strong", 0.70)):
        assert 1 - 1 / severity_factor(sev) == pytest.approx(loss)
    assert fail_at(3, 5, "slow", severity="medium").factor == pytest.approx(1 / 0.45)


def test_scenarios_load_and_bad_entries_are_named(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps([{"device": 1, "iteration": 2, "kind": "kill"},
                                {"device": 1, "iteration": 6, "kind": "repair"},
                                {"device": 0, "iteration": 3, "kind": "comm", "delay_s": 0.01}]))
    faults = load_scenario(path)
    assert [f.kind for f in faults] == ["kill", "repair", "comm"]
    assert repairs(faults) == {6: (1,)}
    assert [f["kind"] for f in worker_faults(faults)] == ["kill", "comm"]  # workers never see repairs
    for entry, words in (({"device": 0, "iteration": 1, "kind": "melt"}, "melt"),
                         ({"device": 0, "kind": "kill"}, "missing field 'iteration'"),
                         ({"device": 0, "iteration": 1, "kind": "slow", "factor": 0.5}, "factor must be > 1"),
                         ({"device": 0, "iteration": 1, "kind": "kill", "when": 3}, "unknown field")):
        with pytest.raises(FaultError, match="scenario entry 0") as e:
            load_scenario([entry])
        assert words in str(e.value)
    with pytest.raises(FaultError, match="cannot read"):
        load_scenario(tmp_path / "missing.json")


def test_flip_faults_load_with_their_fields_and_bad_ones_are_named() -> None:
    (f,) = load_scenario([{"device": 2, "iteration": 4, "kind": "flip", "target": "optimizer", "bit": 7,
                           "repeat": True}])
    assert (f.kind, f.target, f.bit, f.repeat) == ("flip", "optimizer", 7, True)
    assert worker_faults([f])[0]["target"] == "optimizer"
    for entry, words in (({"target": "weights"}, '"target"'), ({"bit": 64}, '"bit"'),
                         ({"bit": 1.5}, '"bit"'), ({"repeat": "yes"}, '"repeat"')):
        with pytest.raises(FaultError, match="scenario entry 0") as e:
            load_scenario([{"device": 0, "iteration": 1, "kind": "flip", **entry}])
        assert words in str(e.value)


def test_a_flip_corrupts_one_bit_once_and_a_bad_device_every_iteration() -> None:
    import torch

    from resihp_core.runtime.worker.injector import FaultInjector

    def state() -> dict[str, torch.Tensor]:
        return {"b": torch.ones(3, dtype=torch.float64), "a": torch.full((4,), 2.0, dtype=torch.float64)}

    once = FaultInjector(3, [fail_at(3, 2, "flip", target="grad", bit=52).to_dict(),
                             fail_at(4, 2, "flip").to_dict()])  # another device's: not this one's
    t = state()
    once.at_iteration(1)
    once.corrupt("grad", t)
    once.at_iteration(2)
    once.corrupt("param", t)  # not the target
    assert torch.equal(t["a"], state()["a"]) and once.flipped == 0
    once.corrupt("grad", t)
    assert t["a"].tolist() == [4.0, 2.0, 2.0, 2.0] and torch.equal(t["b"], state()["b"])  # bit 52: exponent + 1
    once.corrupt("grad", t)  # once per iteration
    once.at_iteration(2)  # the iteration re-executed: a single flip does not come back
    once.corrupt("grad", t)
    assert once.flipped == 1
    bad = FaultInjector(0, [fail_at(0, 1, "flip", target="optimizer", bit=0, repeat=True).to_dict()])
    for i in range(4):
        bad.at_iteration(i)
        t = state()
        bad.corrupt("optimizer", t)
        assert (t["a"][0].item() != 2.0) == (i >= 1)
    assert bad.flipped == 3
    f32 = FaultInjector(0, [fail_at(0, 0, "flip", bit=63).to_dict()])  # bit 63 of a float32: its sign (31)
    f32.at_iteration(0)
    x = {"x": torch.ones(2)}
    f32.corrupt("grad", x)
    assert x["x"].tolist() == [-1.0, 1.0]
