"""``resihp run CONFIG``: clear errors on bad input, and a real small job with a fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
CLI = [sys.executable, "-m", "resihp_core.cli"]


def test_bad_config_and_bad_scenario_name_the_field(tmp_path: Path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("[parallel]\ntp = 3\n")
    r = subprocess.run([*CLI, "run", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "parallel.tp = 3" in r.stderr
    cfg.write_text("[parallel]\ntp = 1\n")
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps([{"device": 0, "iteration": 1, "kind": "explode"}]))
    r = subprocess.run([*CLI, "run", str(cfg), "--faults", str(faults)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "scenario entry 0" in r.stderr and "explode" in r.stderr


def test_run_survives_a_killed_worker_and_writes_the_report(tmp_path: Path):
    root = Path(__file__).resolve().parents[2]
    cfg = root / "examples" / "configs" / "tp1_pp2_dp2.toml"
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps([{"device": 3, "iteration": 5, "kind": "kill"}]))
    env_iters = {"RESIHP_TRAINING__ITERATIONS": "8"}
    import os

    r = subprocess.run([*CLI, "run", str(cfg), "--faults", str(faults), "--no-live", "--report", str(tmp_path)],
                       capture_output=True, text=True, timeout=200, env={**os.environ, **env_iters})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fail-stop of devices [3]" in r.stdout
    (report,) = list(tmp_path.glob("run-*"))
    events = json.loads((report / "events.json").read_text())
    assert len(events["iterations"]) == 7  # iteration 0 (start-up) is an event, not a row
    assert (report / "iteration_time.png").stat().st_size > 5000
