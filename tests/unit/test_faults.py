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
