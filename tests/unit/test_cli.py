"""The ``resihp`` command: ``plugins`` and ``plan show``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from resihp_core.cli import COMMANDS, main
from resihp_core.plan import ParallelPlan
from resihp_core.plugins import ENV_BLOCK, ENV_DISABLE_AUTOLOAD, reset_plugins

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD, raising=False)
    monkeypatch.delenv(ENV_BLOCK, raising=False)
    reset_plugins()
    yield
    reset_plugins()


def run_cli(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``resihp ARGS`` in a fresh process (entry points are read at start-up)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIHP_")}
    env.update(extra_env or {})
    script = Path(sys.executable).with_name("resihp")  # the installed console script
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "resihp_core.cli"]
    return subprocess.run(
        [*cmd, *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )


def test_commands_are_a_registry() -> None:
    assert {"plugins", "plan"} <= set(COMMANDS)


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err
    assert main(["--version"]) == 0


def test_plugins_lists_first_party_adapters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for word in ("megatron_ref", "deepspeed", "entry point", "1f1b,gpipe,zbh1",
                 "resihp_adapters.deepspeed.adapter:DeepSpeedAdapter"):
        assert word in out


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    adapters = {a["name"]: a for a in rep["adapters"]}
    assert adapters["deepspeed"]["capabilities"]["schedules"] == ["1f1b"]
    assert adapters["deepspeed"]["capabilities"]["heterogeneous_tp"] is False
    assert adapters["megatron_ref"]["capabilities"]["heterogeneous_tp"] is True
    plugins = {p["name"]: p for p in rep["plugins"]}
    assert plugins["megatron_ref"]["source"] == "entry point"
    assert plugins["megatron_ref"]["distribution"] == "resihp"


def test_plugins_honours_switches(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ENV_BLOCK, "deepspeed")
    assert main(["plugins", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    names = [a["name"] for a in rep["adapters"]]
    assert "deepspeed" not in names and "megatron_ref" in names
    assert rep["blocked"] == ["deepspeed"]

    reset_plugins()
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "autoload disabled" in out and "megatron_ref" not in out


def test_plugins_reports_a_broken_plugin(tmp_path: Path) -> None:
    (tmp_path / "brokenplug.py").write_text("raise ImportError('needs libfoo')\n")
    info = tmp_path / "brokenplug-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[resihp]\nbrokenplug = brokenplug\n")
    env = {"PYTHONPATH": str(tmp_path)}
    res = run_cli("plugins", extra_env=env)
    assert res.returncode == 1
    assert "resihp: error: plugin 'brokenplug'" in res.stderr and "RESIHP_BLOCK_PLUGINS" in res.stderr
    assert run_cli("plugins", extra_env={**env, ENV_BLOCK: "brokenplug"}).returncode == 0


@pytest.mark.slow
def test_installed_example_adapter_is_listed(tmp_path: Path) -> None:
    # Build from a copy so the in-tree build leaves nothing in examples/.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "examples" / "custom_adapter", src)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True, timeout=180,
    )
    env = {"PYTHONPATH": str(target)}
    res = run_cli("plugins", "--json", extra_env=env)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    example = {a["name"]: a for a in rep["adapters"]}["example"]
    assert example["target"] == "resihp_example_adapter.adapter:ExampleAdapter"
    assert example["capabilities"]["schedules"] == ["1f1b", "gpipe"] and example["capabilities"]["checkpoint"]
    assert {"megatron_ref", "deepspeed", "example"} <= {a["name"] for a in rep["adapters"]}
    assert "example" in run_cli("plugins", extra_env=env).stdout

    # The installed adapter is created through the registry (its behaviour under the
    # lifecycle is the conformance kit's business: tests/conformance).
    script = (
        "from resihp_core.adapter import AdapterContext\n"
        "from resihp_core.job import JobSpec\n"
        "from resihp_core.plugins import get_plugins\n"
        "a = get_plugins().adapters().create('example', AdapterContext(2, JobSpec(adapter='example'), None, None))\n"
        "print(type(a).__name__, a.where, a.capabilities.checkpoint)\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ExampleAdapter None True"


def test_plan_show_prints_the_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4)
    path = tmp_path / "plan.txt"
    path.write_text(plan.to_text())
    assert main(["plan", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == plan.grid().strip()
    assert "tp2: 0,1" in out


def test_plan_show_rejects_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = ParallelPlan.uniform(tp=2, pp=2, dp=1, num_layers=4, num_microbatches=2).to_text()
    bad = tmp_path / "bad.txt"
    bad.write_text(good.replace("replica 0: 0,1 | 2,3", "replica 0: 0,1,2 | 3"))
    assert main(["plan", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("resihp: error: ") and str(bad) in err
    assert "not a power of two" in err

    garbage = tmp_path / "garbage.txt"
    garbage.write_text("hello\n")
    assert main(["plan", "show", str(garbage)]) == 2
    assert "must start with 'resihp-plan v1'" in capsys.readouterr().err

    assert main(["plan", "show", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read plan file" in capsys.readouterr().err
    assert main(["plan"]) == 2  # no action


def test_plan_show_in_a_subprocess(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("resihp-plan v1\nlayers four\n")
    res = run_cli("plan", "show", str(bad))
    assert res.returncode == 2
    assert "line 2" in res.stderr


def test_resihp_run_assembles_its_job_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``resihp run`` checks and builds the job in one assembly, and runs that one."""
    import argparse

    from resihp_core.cli import run as jobs

    calls: list[object] = []
    real = jobs.assemble

    def counting(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    ran: dict = {}

    def run_job(cfg, faults, args, title, tag, *, job=None, work=None):
        ran.update(job=job, work=work)
        return 0

    monkeypatch.setattr(jobs, "assemble", counting)
    monkeypatch.setattr(jobs, "run_job", run_job)
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tp1_pp2_dp2.toml"
    args = argparse.Namespace(config=str(config), faults=None, agents="local", workdir=str(tmp_path / "w"))
    assert jobs.run_config(args) == 0
    assert len(calls) == 1 and ran["job"] is calls[0]
    assert ran["work"] == (tmp_path / "w").resolve()
    assert calls[0].spec.checkpoint_dir == str((tmp_path / "w" / "checkpoints").resolve())
