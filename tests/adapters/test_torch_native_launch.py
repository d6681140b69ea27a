"""The torch-native example under the real ``accelerate launch`` (FSDP2 config: stock
pipelining + fully_shard, it trains) and under ``resihp launch`` with a rank SIGKILLed
at iteration 2: the siblings keep their processes, every iteration commits, and the
global losses equal the plain run's (float64, the job's synthetic data)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_native"
BIN = Path(sys.executable).parent
LINE = re.compile(r"rank=(\d+) pid=(\d+) iteration=(\d+)(?: loss=([0-9.e+-]+))?")
COMMITTED = re.compile(r"^iteration\s+(\d+)\s+loss ([0-9.]+)", re.M)
ITERATIONS = 4

pytestmark = pytest.mark.integration


def _copy(tmp: Path) -> Path:
    tmp.mkdir()
    for f in ("accelerate.yaml", "train.py"):
        shutil.copy(EXAMPLE / f, tmp / f)
    text = (EXAMPLE / "resihp.toml").read_text()
    text = re.sub(r"iterations = \d+", f"iterations = {ITERATIONS}", text)
    (tmp / "resihp.toml").write_text(text)
    return tmp


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    """Start ``cmd`` in its own process group (:func:`_finish` collects it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RESIHP_CONFIG", None)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for ``p``; on timeout kill its process group (only what this test started)
    and fail with the output so far."""
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{p.args[:2]} timed out:\n{out[-4000:]}")
    return p.returncode, out


def _run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` to its end (:func:`_start`, :func:`_finish`)."""
    return _finish(_start(cmd, cwd), timeout)


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    """Kill the process group of each of ``procs`` still running (a failed test)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def _lines(text: str) -> list[tuple[int, int, int, float | None]]:
    return [(int(r), int(p), int(i), float(l) if l else None) for r, p, i, l in LINE.findall(text)]


@pytest.mark.timeout(420)
def test_accelerate_launch_trains_and_resihp_launch_survives_a_killed_rank(tmp_path):
    plain = _copy(tmp_path / "plain")
    res = _copy(tmp_path / "resihp")
    (res / "kill.json").write_text(json.dumps([{"device": 3, "iteration": 2, "kind": "kill"}]))
    work = tmp_path / "work"
    # The plain run (the reference) and the ResiHP run start together: each spends much of
    # its time in one process (launcher, imports, teardown) or waiting on peers, so on 2
    # cores together they take less wall time than one after the other.
    procs = [_start([str(BIN / "accelerate"), "launch", "--config_file", "accelerate.yaml", "train.py"], plain),
             _start([str(BIN / "resihp"), "launch", "--config_file", "accelerate.yaml", "--faults", "kill.json",
                     "--workdir", str(work), "--timeout", "240", "train.py"], res)]
    try:
        (rc, out), (rc_ours, ours) = _finish(procs[0], 240), _finish(procs[1], 300)
    finally:
        _kill_groups(procs)
    assert rc == 0, out[-4000:]
    ref: dict[int, float] = {}
    for r, p, i, l in _lines(out):
        if l is not None:  # each last-stage rank prints its replica's share
            ref[i] = ref.get(i, 0.0) + l
    assert sorted(ref) == list(range(1, ITERATIONS + 1)), out[-2000:]

    rc, out = rc_ours, ours
    assert rc == 0, out[-4000:]
    assert f"{ITERATIONS} iterations committed" in out
    committed = {int(i): float(l) for i, l in COMMITTED.findall(out)}
    assert sorted(committed) == list(range(ITERATIONS)), out[-3000:]
    for i, loss in committed.items():  # the controller's global loss of iteration i
        assert abs(loss - ref[i + 1]) <= 1e-9 * ref[i + 1] + 1e-10, (i, loss, ref[i + 1])
    seen: dict[int, set[int]] = {}
    last: dict[int, int] = {}
    for d in range(4):
        for r, p, i, l in _lines((work / "job" / f"worker{d}.log").read_text()):
            seen.setdefault(r, set()).add(p)
            last[r] = max(last.get(r, 0), i)
    assert last.get(3, 0) <= 2, "the killed rank went on training"
    for r in (0, 1, 2):
        assert len(seen[r]) == 1, f"rank {r} changed process"
    # The survivors' next plan runs on some of them (the Scheduler may keep one as a
    # standby, alive in its process): they trained every remaining iteration.
    assert sum(last[r] == ITERATIONS for r in (0, 1, 2)) >= 2, last
