"""User configuration: file formats, environment overrides, defaults and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resihp_core.config import Config, ConfigError, DetectorConfig, load_config

TOML = """
[detector]
heartbeat_miss_limit = 5
slow_threshold = 0.3

[scheduler]
delta = 2
schedule = "zbh1"

[parallel]
tp = 2
pp = 2
dp = 2

[runtime]
controller_port = 31000
secret = "from-file"
nodes = 2

[model]
layers = 4

[training]
dtype = "float64"
lr = 1
"""

YAML = """
detector:
  heartbeat_interval_s: 0.05
  changepoint_hazard: 1e-3   # PyYAML reads this as text; a float field accepts it
scheduler:
  schedule: gpipe
  k_min: 2
parallel: {tp: 2, pp: 1, dp: 2}
training:
  microbatches: 8
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------ sources
def test_defaults_when_nothing_is_given() -> None:
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.detector.heartbeat_interval_s == 0.1
    assert cfg.detector.heartbeat_miss_limit == 3
    assert cfg.detector.slow_threshold == 0.25
    assert cfg.runtime.controller_host == "127.0.0.1"
    assert cfg.scheduler.schedule == "1f1b"
    assert cfg.training.dtype == "float32"


def test_toml_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "job.toml", TOML), env={})
    assert cfg.detector.heartbeat_miss_limit == 5
    assert cfg.detector.slow_threshold == 0.3
    assert cfg.detector.heartbeat_interval_s == 0.1  # untouched keys keep defaults
    assert cfg.scheduler.delta == 2 and cfg.scheduler.schedule == "zbh1"
    assert cfg.parallel.world_size == 8
    assert cfg.runtime.controller_port == 31000 and cfg.runtime.nodes == 2
    assert cfg.runtime.secret == "from-file"
    assert cfg.model.layers == 4
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)


def test_yaml_file(tmp_path: Path) -> None:
    cfg = load_config(str(write(tmp_path, "job.yaml", YAML)), env={})
    assert cfg.detector.heartbeat_interval_s == 0.05
    assert cfg.detector.changepoint_hazard == 1e-3
    assert cfg.scheduler.schedule == "gpipe" and cfg.scheduler.k_min == 2
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp) == (2, 1, 2)
    assert cfg.training.microbatches == 8


def test_empty_yaml_means_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "empty.yml", ""), env={}) == Config()


def test_env_overrides_file_values(tmp_path: Path) -> None:
    env = {
        "RESIHP_DETECTOR__SLOW_THRESHOLD": "0.4",
        "RESIHP_DETECTOR__HEARTBEAT_MISS_LIMIT": " 7 ",
        "resihp_runtime__secret".upper(): "from-env",
        "RESIHP_SCHEDULER__SCHEDULE": "gpipe",
        "RESIHP_RANK": "3",  # not an override: no SECTION__FIELD
        "PATH": "/usr/bin",
    }
    cfg = load_config(write(tmp_path, "job.toml", TOML), env=env)
    assert cfg.detector.slow_threshold == 0.4
    assert cfg.detector.heartbeat_miss_limit == 7
    assert cfg.runtime.secret == "from-env"
    assert cfg.scheduler.schedule == "gpipe"
    assert cfg.scheduler.delta == 2  # from the file


def test_config_path_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, "job.toml", TOML)
    assert load_config(env={"RESIHP_CONFIG": str(path)}).runtime.controller_port == 31000


def test_from_dict_and_toml_round_trip(tmp_path: Path) -> None:
    cfg = Config.from_dict({"detector": {"slow_threshold": 0.5}, "model": {"hidden": 128, "heads": 8}})
    assert cfg.detector.slow_threshold == 0.5 and cfg.model.heads == 8
    again = load_config(write(tmp_path, "dump.toml", cfg.to_toml()), env={})
    assert again == cfg


def test_secret_is_hidden() -> None:
    cfg = load_config(env={"RESIHP_RUNTIME__SECRET": "hunter2"})
    assert "hunter2" not in repr(cfg)
    assert "hunter2" not in cfg.to_toml()
    assert "hunter2" in cfg.to_toml(include_secrets=True)


@given(
    st.floats(0.001, 10, allow_nan=False),
    st.integers(1, 100),
    st.sampled_from(["gpipe", "1f1b", "zbh1"]),
)
def test_env_text_parses_to_field_types(threshold: float, misses: int, schedule: str) -> None:
    cfg = load_config(
        env={
            "RESIHP_DETECTOR__SLOW_THRESHOLD": repr(threshold),
            "RESIHP_DETECTOR__HEARTBEAT_MISS_LIMIT": str(misses),
            "RESIHP_SCHEDULER__SCHEDULE": schedule,
        }
    )
    assert cfg.detector.slow_threshold == threshold
    assert cfg.detector.heartbeat_miss_limit == misses
    assert cfg.scheduler.schedule == schedule


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.detector.slow_threshold = 1.0  # type: ignore[misc]


# ------------------------------------------------------------------ errors
def test_bad_type_in_file_names_field_value_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.toml", '[detector]\nheartbeat_miss_limit = "three"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    msg = str(info.value)
    assert "detector.heartbeat_miss_limit" in msg and "'three'" in msg and str(path) in msg
    assert info.value.path == "detector.heartbeat_miss_limit" and info.value.value == "three"


def test_bool_is_not_an_int(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="detector.heartbeat_miss_limit"):
        load_config(write(tmp_path, "bad.toml", "[detector]\nheartbeat_miss_limit = true\n"), env={})


def test_bad_range_in_file_names_field_value_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.yaml", "detector:\n  slow_threshold: -0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    msg = str(info.value)
    assert "detector.slow_threshold" in msg and "-0.1" in msg and str(path) in msg and "> 0" in msg


@pytest.mark.parametrize(
    "env, field, value",
    [
        ({"RESIHP_DETECTOR__HEARTBEAT_MISS_LIMIT": "0"}, "detector.heartbeat_miss_limit", "0"),
        ({"RESIHP_DETECTOR__HEARTBEAT_MISS_LIMIT": "abc"}, "detector.heartbeat_miss_limit", "'abc'"),
        ({"RESIHP_RUNTIME__CONTROLLER_PORT": "70000"}, "runtime.controller_port", "70000"),
        ({"RESIHP_SCHEDULER__DELTA": "-1"}, "scheduler.delta", "-1"),
        ({"RESIHP_SCHEDULER__SCHEDULE": "zb"}, "scheduler.schedule", "'zb'"),
        ({"RESIHP_SCHEDULER__K_MIN": "3"}, "scheduler.k_min", "3"),
        ({"RESIHP_TRAINING__DTYPE": "float16"}, "training.dtype", "'float16'"),
        ({"RESIHP_DETECTOR__HEARTBEAT_INTERVAL_S": "nan"}, "detector.heartbeat_interval_s", "nan"),
    ],
)
def test_bad_env_values_name_variable_field_and_value(env: dict[str, str], field: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    msg = str(info.value)
    (var,) = env
    assert var in msg and field in msg and value in msg


def test_unknown_keys_are_rejected_with_a_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "typo.toml", "[detector]\nslow_treshold = 0.3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    msg = str(info.value)
    assert "detector.slow_treshold" in msg and "did you mean 'slow_threshold'" in msg and str(path) in msg

    with pytest.raises(ConfigError, match=r"detektor.*did you mean 'detector'"):
        Config.from_dict({"detektor": {}})
    with pytest.raises(ConfigError, match=r"RESIHP_SCHEDULER__DELTAA.*scheduler.deltaa.*'delta'"):
        load_config(env={"RESIHP_SCHEDULER__DELTAA": "1"})


def test_cross_section_checks_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"parallel.dp = 4.*runtime.nodes"):
        Config.from_dict({"parallel": {"dp": 4}})  # 1 x 2 x 4 > 1 node x 4 devices
    with pytest.raises(ConfigError, match=r"model.heads = 5"):
        Config.from_dict({"model": {"heads": 5}})
    with pytest.raises(ConfigError, match=r"parallel.tp = 8.*model.heads"):
        Config.from_dict({"parallel": {"tp": 8, "pp": 1, "dp": 1}, "runtime": {"devices_per_node": 8}})


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="unsupported config file type"):
        load_config(write(tmp_path, "job.ini", "x=1"), env={})
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "broken.toml", "[detector\n"), env={})
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "broken.yaml", "detector: [1, 2\n"), env={})
    with pytest.raises(ConfigError, match="detector: must be a table"):
        load_config(write(tmp_path, "flat.yaml", "detector: 3\n"), env={})
    with pytest.raises(ConfigError, match="top level"):
        load_config(write(tmp_path, "list.yaml", "- 1\n"), env={})


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"detector.slow_threshold = 0.0: must be > 0"):
        DetectorConfig(slow_threshold=0.0)
    assert DetectorConfig(slow_threshold=1).slow_threshold == 1.0


def test_secret_value_never_appears_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"runtime": {"secret": 12345}})
    assert "runtime.secret" in str(info.value) and "12345" not in str(info.value)
