"""The example, an unchanged plain-DeepSpeed pipeline script (stages balanced by
``partition_method="parameters"``, DeepSpeed's shuffled sample order), under the real
``accelerate launch`` (plain DeepSpeed: it trains) and under ``resihp launch``, whose
first plan is the split plain DeepSpeed printed, with a rank SIGKILLed at iteration 2: the siblings keep their
processes, the next plan keeps all three of them busy (the killed rank's replica keeps
its stage 0 and migrates its stage-1 work to the other replica), every iteration
commits, and the losses equal the plain run's (float64, gradient clipping on).
The ResiHP run also saves a checkpoint in DeepSpeed's own format after step 1
(``engine.save_checkpoint``); plain DeepSpeed loads it and trains on to the plain run's
losses."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from resihp_core.plan import parse_plan

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "deepspeed_pipeline"
BIN = Path(sys.executable).parent
LINE = re.compile(r"rank=(\d+) pid=(\d+) iteration=(\d+)(?: loss=([0-9.]+))?")
START = re.compile(r"rank=(\d+) start (stage_id=\d+ local_layers=\d+ optimizer=\w+ lr=\S+ global_steps=\d+)")

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy(tmp: Path, iterations: int, faults: list) -> Path:
    shutil.copy(EXAMPLE / "train.py", tmp / "train.py")
    # torchrun's rendezvous port: a free one, not the default 29500 another job may hold.
    yaml = (EXAMPLE / "accelerate.yaml").read_text()
    (tmp / "accelerate.yaml").write_text(yaml + f"main_process_port: {_free_port()}\n")
    cfg = json.loads((EXAMPLE / "ds_config.json").read_text())
    cfg["resihp"].update(iterations=iterations, faults=faults)
    # Clipping active: the partial-replica plan after the kill clips by the norm plain
    # DeepSpeed computes. 0.01 clips every step (the plain run's stage-0 norms are
    # 0.017-0.022; at 0.02 none of the first four steps clipped).
    cfg["gradient_clipping"] = 0.01
    (tmp / "ds_config.json").write_text(json.dumps(cfg))
    return tmp


def _lines(text: str) -> list[tuple[int, int, int, float | None]]:
    return [(int(r), int(p), int(i), float(l) if l else None) for r, p, i, l in LINE.findall(text)]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _finish(p: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``p`` (killed by pid on a timeout) and collect its output."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"{p.args} did not finish in {timeout} s:\n{out[-2000:]}\n{err[-2000:]}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.timeout(600)
def test_accelerate_launch_trains_and_resihp_launch_survives_a_killed_rank(tmp_path):
    iters, saved_at = 4, 1
    plain = tmp_path / "plain"
    plain.mkdir()
    _copy(plain, iters, [])
    res = tmp_path / "resihp"
    res.mkdir()
    _copy(res, iters, [{"device": 3, "iteration": 2, "kind": "kill"}])
    work = tmp_path / "work"
    ckpt = tmp_path / "ds-checkpoint"
    # The plain run (the reference) and the ResiHP run start together: each spends most
    # of its time starting processes and waiting on peers, so together they take less
    # wall time than one after the other (the ResiHP launch's partition probe included).
    procs = [subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, cwd in (
                 ([str(BIN / "accelerate"), "launch", "--config_file", "accelerate.yaml", "train.py",
                   "--iterations", str(iters)], plain),
                 ([str(BIN / "resihp"), "launch", "--config_file", "accelerate.yaml", "--workdir", str(work),
                   "--timeout", "300", "train.py", "--iterations", str(iters), "--save-dir", str(ckpt),
                   "--save-at", str(saved_at)], res))]
    try:
        out, ours = _finish(procs[0], 300), _finish(procs[1], 360)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    plain_out = out.stdout + out.stderr
    ref = {i: l for r, p, i, l in _lines(plain_out) if l is not None}
    assert sorted(ref) == list(range(1, iters + 1)), out.stdout[-2000:]

    # DeepSpeed's engine API right after initialize, before the first step (module,
    # stage_id, optimizer, get_lr()[0], global_steps): DeepSpeed's (2, 4) split, ranks
    # stage-major as DeepSpeed numbers them.
    want = {r: f"stage_id={r // 2} local_layers={(2, 4)[r // 2]} optimizer=AdamW lr=0.001 global_steps=0"
            for r in range(4)}
    assert dict((int(r), t) for r, t in START.findall(plain_out)) == want, plain_out[-2000:]

    out = ours
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{iters} iterations committed" in out.stdout
    # The first plan's stages are the split plain DeepSpeed's PipelineModule printed for
    # the script's partition_method="parameters" (the launcher's probe run), not uniform.
    ds_split = [int(n) for n in re.findall(r"^stage=\d+ layers=(\d+)$", plain_out, re.M)]
    assert ds_split == [2, 4], plain_out[-2000:]
    assert "(PP2 x DP2, stages 0-2 2-6: partition_method parameters)" in out.stdout, out.stdout[:2000]
    # The partition probe ran the script alone, its deepspeed.init_distributed() deferred.
    assert "init_distributed() deferred" in (work / "partition-probe.log").read_text()
    # The plan after the kill keeps all 3 survivors busy: replica 1 keeps device 1 on
    # stage 0 and hands its stage-1 micro-batches to replica 0 (cross-replica migration),
    # and DeepSpeed runs that plan as it is (no device idles).
    events = json.loads((work / "events.json").read_text())  # every event in full
    plan = parse_plan(next(ev["plan"] for ev in events if ev["kind"] == "plan"
                           and ev["text"].startswith("generation 1 ")))
    assert {d: plan.location(d) is not None for d in range(4)} == {0: True, 1: True, 2: True, 3: False}, \
        plan.to_text()
    assert plan.migrations and not plan.standbys, plan.to_text()
    w1 = (work / "job" / "worker1.log").read_text()
    assert "generation 1: device 1 runs replica 1 stage 0 (partial-replica plan)" in w1, w1[-2000:]
    seen: dict[int, set[int]] = {}
    last: dict[int, int] = {}
    losses: dict[int, float] = {}
    starts: dict[int, str] = {}
    for d in range(4):
        log = (work / "job" / f"worker{d}.log").read_text()
        starts.update((int(r), t) for r, t in START.findall(log))
        # The script's own deepspeed.init_distributed() (a world of all launched ranks)
        # waits for initialize(), which builds each generation's groups.
        assert "resihp: deepspeed.init_distributed() deferred" in log, log[-2000:]
        # A worker whose gloo threads outlived the interpreter died with SIGABRT here.
        assert "terminate called" not in log, log[-2000:]
        for r, p, i, l in _lines(log):
            seen.setdefault(r, set()).add(p)
            last[r] = max(last.get(r, 0), i)
            if l is not None:
                losses.setdefault(i, l)
                assert abs(l - ref[i]) <= 1e-9 * ref[i], (r, i, l, ref[i])
    assert last.get(3, 0) < 3, "the killed rank went on training"
    for r in (0, 1, 2):
        assert len(seen[r]) == 1, f"rank {r} changed process"
        assert last[r] == iters, f"rank {r} stopped at iteration {last[r]}"
    assert sorted(losses) == list(range(1, iters + 1))
    assert starts == want, starts

    # DeepSpeed's own files, as plain DeepSpeed writes them (one stage's optimizer state
    # per model-parallel rank, layers by global index), and plain DeepSpeed trains on.
    tag = ckpt / (ckpt / "latest").read_text().strip()
    assert tag.name == f"global_step{saved_at}", tag
    assert {f.name for f in tag.iterdir()} >= {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                                              *(f"layer_{i:02d}-model_states.pt" for i in range(6))}
    out = _run([str(BIN / "accelerate"), "launch", "--config_file", "accelerate.yaml", "train.py",
                "--iterations", str(iters), "--load-dir", str(ckpt)], plain, 240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = {i: l for r, p, i, l in _lines(out.stdout + out.stderr) if l is not None}
    assert sorted(resumed) == list(range(saved_at + 1, iters + 1)), out.stdout[-2000:]
    for i, l in resumed.items():
        assert abs(l - ref[i]) <= 1e-9 * ref[i], (i, l, ref[i])
