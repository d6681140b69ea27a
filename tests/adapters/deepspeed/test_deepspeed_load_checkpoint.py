"""``engine.load_checkpoint`` (DeepSpeed's format) loads everything or nothing: from a
missing directory, a missing tag, a corrupt layer file (DeepSpeed has loaded the layers
before it when it fails), another model's checkpoint and another step's, every
parameter, optimizer moment, the LR and the step count stay as they were; from the good
checkpoint everything loads. One DeepSpeed process (``_load_atomic_worker.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]
HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_load_checkpoint_of_a_bad_directory_changes_nothing(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(HERE / "_load_atomic_worker.py"), "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["missing"] == {"outcome": "returned None", "unchanged": True}  # DeepSpeed's answer: nothing loaded
    for case, why in (("missing_tag", "global_step99/mp_rank_00_model_states.pt does not exist"),
                      ("corrupt", "rank 0: RuntimeError"), ("other_model", "size mismatch"),
                      ("other_step", "is of step 3, the job stands at iteration 2")):
        assert r[case]["outcome"].startswith("refused: engine.load_checkpoint("), (case, r[case])
        assert why in r[case]["outcome"] and "nothing was loaded" in r[case]["outcome"], (case, r[case])
        assert r[case]["unchanged"], (case, r[case])
    assert r["good"]["loaded"], r["good"]
