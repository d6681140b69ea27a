"""``benchmarks/gpu_check.py --quick`` on this machine (CPU in CI): the prepared device
check runs end to end through the production path and its table and JSON say what
ran where, with exact training after each fault (docs/gpu.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_quick_prints_its_table_and_writes_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for heading in ("scenario", "device", "backend", "fault->first s", "exact?", "MAPE %"):
        assert heading in proc.stdout
    res = json.loads(out.read_text())
    assert res["quick"] is True and res["machine"]["cuda_available"] == torch.cuda.is_available()
    rows = {r["scenario"]: r for r in res["rows"]}
    kill = rows["torch_native kill"]
    demo = next(r for name, r in rows.items() if name.startswith("reference demo"))
    expected = ("cuda", "nccl") if torch.cuda.device_count() >= 2 else (
        ("cuda" if torch.cuda.is_available() else "cpu"), "gloo")
    assert (demo["device"], demo["backend"]) == expected
    for r in (kill, demo):
        assert r["exact"] is True, r  # losses equal the fault-free reference after the fault
        assert r["fault_to_first_s"] is not None and r["fault_to_first_s"] > 0
        assert r["adapted_after"] == 0  # the iteration the fault hit ran under a new plan
    # The survivors' state moved to the new layout: resumed where it was, no restart.
    # (The quick demo has one replica and no checkpoint: the killed TP member's shard had
    # no other copy, so it restarts from the initial state and says how much it redid.)
    assert kill["redone"] == 0, kill
    assert demo["redone"] is not None and demo["redone"] >= 0, demo
    assert math.isfinite(demo["mape_pct"]) and demo["extra"]["held_out_iterations"] >= 1
    tp = rows["torch_native TP shrink"]
    from resihp_adapters.torch_native.plugin import CAPABILITIES

    assert tp["note"].startswith("not run here" if CAPABILITIES.tp_resize else "not available")
    assert rows["torch_native slow"]["note"] == "not run with --quick"
    if not torch.cuda.is_available():
        assert rows["megatron_core on GPUs, NCCL"]["note"] == "not run: no GPU here"
    for name in ("NCCL shrink vs rebuild", "NCCL abort, blocked survivor"):  # need several GPUs
        if torch.cuda.device_count() < 2:
            assert rows[name]["note"].startswith("skipped: needs >= 2 GPUs" if torch.cuda.is_available()
                                                 else "not run: no GPU here"), rows[name]
            assert rows[name]["exact"] is None, rows[name]
        else:
            assert rows[name]["exact"] is True, rows[name]
