"""``resihp run`` on real documents: the stdlib example config, a fail-slow and a kill,
losses equal to the fault-free reference, no false alarm before the first fault; and a
bad [data] section is refused before any worker starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CLI = [sys.executable, "-m", "resihp_core.cli"]
ROOT = Path(__file__).resolve().parents[2]


def test_a_bad_data_section_is_named_before_workers_start(tmp_path: Path) -> None:
    cfg = tmp_path / "job.toml"
    cfg.write_text('[data]\nsource = "text"\nroot = "{stdlib}"\npaths = ["*.nothing"]\n')
    r = subprocess.run([*CLI, "run", str(cfg), "--no-live", "--report", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "data.paths" in r.stderr and "no file matches" in r.stderr, r.stderr


def test_stdlib_example_survives_a_fail_slow_and_a_kill(tmp_path: Path) -> None:
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps([{"device": 2, "iteration": 5, "kind": "slow", "severity": "strong"},
                                  {"device": 1, "iteration": 11, "kind": "kill"}]))
    env = {**os.environ, "RESIHP_TRAINING__ITERATIONS": "14", "RESIHP_TRAINING__TOKEN_BUDGET": "256",
           "RESIHP_TRAINING__DTYPE": "float64"}
    r = subprocess.run([*CLI, "run", str(ROOT / "examples" / "configs" / "stdlib_text.toml"), "--faults",
                        str(faults), "--no-live", "--report", str(tmp_path)],
                       capture_output=True, text=True, timeout=280, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fail-stop of devices [1]" in r.stdout
    worst = float(re.search(r"max relative difference (\S+)", r.stdout).group(1))
    assert worst <= 1e-9, r.stdout[-2000:]
    (report,) = list(tmp_path.glob("run-*"))
    data = json.loads((report / "events.json").read_text())
    failures = [e for e in data["events"] if e["kind"] == "failure"]
    assert failures and all(e["iteration"] >= 5 for e in failures), failures  # no false alarm before it
    assert any(e.get("failure") == "fail-slow" and e.get("devices") == [2] for e in failures), failures
    losses = [row["loss"] for row in data["iterations"]]
    assert losses[-1] < losses[0]  # it learns from the standard library's bytes
