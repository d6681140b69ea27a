"""Up-front validation: every bad configuration or faults-file field is refused with a
message naming it, before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resihp_core.config import Config, ConfigError, memory_estimate
from resihp_core.faults import FaultError, fail_at, load_scenario

DEVICES = range(8)


def scenario(entry: dict, **kw) -> list:
    return load_scenario([entry], devices=DEVICES, iterations=20, **kw)


@pytest.mark.parametrize("device, problem", [
    ("abc", '"device" = \'abc\': expected an integer'),
    (None, '"device" = null: expected an integer'),
    (1.7, '"device" = 1.7: expected an integer'),
    (True, '"device" = True: expected an integer'),
    (-1, '"device" = -1: must be >= 0'),
    (99, '"device" = 99: not a device of the job (devices 0-7)'),
])
def test_fault_device_field(device, problem) -> None:
    with pytest.raises(FaultError) as e:
        scenario({"device": device, "iteration": 1, "kind": "kill"})
    assert str(e.value).startswith(f"scenario entry 0: {problem}"), str(e.value)


@pytest.mark.parametrize("entry, problem", [
    ({"device": 0, "iteration": "3", "kind": "kill"}, '"iteration" = \'3\': expected an integer'),
    ({"device": 0, "iteration": 2.5, "kind": "kill"}, '"iteration" = 2.5: expected an integer'),
    ({"device": 0, "iteration": 20, "kind": "kill"}, '"iteration" = 20: the job runs iterations 0-19'),
    ({"device": 0, "iteration": 1, "kind": 7}, '"kind" = 7: expected one of'),
    ({"device": 0, "iteration": 1, "kind": "explode"}, '"kind" = \'explode\': not one of'),
    ({"device": 0, "iteration": 1, "kind": "slow", "severity": "huge"}, '"severity" = \'huge\': not one of'),
    ({"device": 0, "iteration": 1, "kind": "slow", "factor": "2"}, '"factor" = \'2\': expected a number'),
    ({"device": 0, "iteration": 1, "kind": "slow", "factor": 0.5}, '"factor" = 0.5: factor must be > 1'),
    ({"device": 0, "iteration": 1, "kind": "slow", "factor": float("inf")}, '"factor" = inf: expected a finite'),
    ({"device": 0, "iteration": 1, "kind": "slow", "factor": 2, "severity": "weak"}, 'not both'),
    ({"device": 0, "iteration": 1, "kind": "comm", "delay_s": None}, '"delay_s" = null'),
    ({"device": 0, "iteration": 1, "kind": "comm"}, '"delay_s" = 0.0: delay_s must be > 0'),
    ({"device": 0, "kind": "kill"}, "missing field 'iteration'"),
    ({"device": 0, "iteration": 1, "kind": "kill", "node": 1}, "unknown field(s) ['node']"),
])
def test_fault_fields_are_named(entry, problem) -> None:
    with pytest.raises(FaultError) as e:
        scenario(entry)
    assert str(e.value).startswith("scenario entry 0: ") and problem in str(e.value), str(e.value)


def test_good_faults_file_and_the_api(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps([{"device": 3, "iteration": 5, "kind": "kill"},
                                {"device": 7, "iteration": 2, "kind": "slow", "severity": "medium"}]))
    faults = load_scenario(path, devices=DEVICES, iterations=20)
    assert [(f.device, f.kind) for f in faults] == [(3, "kill"), (7, "slow")]
    assert faults[1].factor == pytest.approx(1 / 0.45)
    with pytest.raises(FaultError, match='"device" = 1.7'):
        fail_at(1.7, 3, "kill")  # type: ignore[arg-type]


def cfg(**sections) -> Config:
    base = {"parallel": {"tp": 1, "pp": 2, "dp": 2}, "runtime": {"nodes": 2, "devices_per_node": 2}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return Config.from_dict(base, source="test.toml")


def test_layout_must_use_exactly_the_devices() -> None:
    with pytest.raises(ConfigError, match=r"parallel.dp = 1: tp x pp x dp = 2 devices.*2 device\(s\) would never be used"):
        cfg(parallel={"dp": 1})
    with pytest.raises(ConfigError, match=r"parallel.dp = 4: tp x pp x dp = 8 devices, but runtime.nodes"):
        cfg(parallel={"dp": 4})
    assert cfg().parallel.world_size == 4


def test_a_model_that_cannot_fit_is_refused_naming_the_fields() -> None:
    with pytest.raises(ConfigError) as e:
        cfg(model={"hidden": 1_000_000_000, "heads": 4})
    text = str(e.value)
    assert text.startswith("test.toml: model.hidden = 1000000000: the model cannot fit")
    assert "scheduler.device_memory_gib = 80" in text
    with pytest.raises(ConfigError, match="expected int, got float"):
        cfg(model={"hidden": 1e9})
    # The same model fits once the device memory says so; the estimate scales with it.
    small = cfg(model={"hidden": 4096, "heads": 32, "layers": 4, "ffn_hidden": 16384})
    est = memory_estimate(small)
    assert est["parameters"] == pytest.approx((2 * (4 * 4096**2 + 3 * 4096 * 16384 + 2 * 4096) + 256 * 4096) * 4)
    assert est["optimizer"] == pytest.approx(3 * est["parameters"])
    with pytest.raises(ConfigError, match="cannot fit"):
        cfg(model={"hidden": 4096, "heads": 32, "layers": 4, "ffn_hidden": 16384},
            scheduler={"device_memory_gib": 0.5})


def test_other_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match=r"runtime.controller_host = 'http://x'"):
        cfg(runtime={"controller_host": "http://x"})


def test_resihp_run_refuses_a_model_too_big_for_this_machine() -> None:
    from resihp_core.runtime.controller.jobs import check_fits_here

    big = cfg(model={"hidden": 16384, "heads": 32, "layers": 2, "ffn_hidden": 16384},
              scheduler={"device_memory_gib": 1e6})
    with pytest.raises(ConfigError, match="model.hidden = 16384: the 4 workers of this machine need"):
        check_fits_here(big)
    check_fits_here(big, "external")  # other hosts: only the per-device check applies
    check_fits_here(cfg())
