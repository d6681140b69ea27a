"""Three kills on PP2 x DP2 (the example, float64): after the third only one device is
left, which cannot hold two stages; the restore runs the whole model as one stage on it
(the model fits one device), and the job trains to the end with the losses of plain
DeepSpeed's uninterrupted run (``accelerate launch``), to 1e-9, gradient clipping on."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_deepspeed_launch import BIN, EXAMPLE, _env, _finish, _free_port, _lines  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]
ITERS = 8
KILLS = [{"device": 2, "iteration": 2, "kind": "kill"}, {"device": 1, "iteration": 4, "kind": "kill"},
         {"device": 0, "iteration": 6, "kind": "kill"}]


def _job(d: Path, faults: list) -> None:
    d.mkdir()
    shutil.copy(EXAMPLE / "train.py", d / "train.py")
    (d / "accelerate.yaml").write_text((EXAMPLE / "accelerate.yaml").read_text()
                                       + f"main_process_port: {_free_port()}\n")
    cfg = json.loads((EXAMPLE / "ds_config.json").read_text())
    # Clipping on (both runs): DeepSpeed's clip norm counts stage 0's layers only, so a
    # restore onto one stage must keep counting the initial stage 0's, not all six.
    # 0.01 clips every step (plain run's stage-0 norms: 0.017-0.022).
    cfg["gradient_clipping"] = 0.01
    cfg["resihp"].update(iterations=ITERS, faults=faults)
    (d / "ds_config.json").write_text(json.dumps(cfg))


@pytest.mark.timeout(900)
def test_three_kills_leave_one_device_that_trains_the_whole_model_exactly(tmp_path):
    plain, res, work = tmp_path / "plain", tmp_path / "resihp", tmp_path / "work"
    _job(plain, [])
    _job(res, KILLS)
    procs = [subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, cwd in (
                 ([str(BIN / "accelerate"), "launch", "--config_file", "accelerate.yaml", "train.py",
                   "--iterations", str(ITERS)], plain),
                 ([str(BIN / "resihp"), "launch", "--config_file", "accelerate.yaml", "--workdir", str(work),
                   "--timeout", "600", "train.py", "--iterations", str(ITERS)], res))]
    try:
        ref_out, out = _finish(procs[0], 400), _finish(procs[1], 800)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert ref_out.returncode == 0, ref_out.stdout[-3000:] + ref_out.stderr[-3000:]
    ref = {i: l for r, p, i, l in _lines(ref_out.stdout + ref_out.stderr) if l is not None}
    assert sorted(ref) == list(range(1, ITERS + 1))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert f"{ITERS} iterations committed" in out.stdout, out.stdout[-4000:]
    # The last plan: one stage of all six layers on device 3, the only survivor.
    last = out.stdout.rsplit("] plan: generation ", 1)[1]
    assert re.search(r"\] layout: stages 0-6; replica 0: 3$", last, re.M), last[:1500]
    losses: dict[int, float] = {}
    for d in range(4):
        for r, p, i, l in _lines((work / "job" / f"worker{d}.log").read_text()):
            if l is not None:
                losses[i] = l
    assert sorted(losses) == list(range(1, ITERS + 1)), losses
    for i, l in losses.items():
        assert abs(l - ref[i]) <= 1e-9 * ref[i], (i, l, ref[i])
