"""The user's own mistakes under ``resihp launch`` end the job with their exception and
their ``file:line`` on the console, never as failed devices (docs/errors.md); a loop that
ends early ends the job normally; device-kind exceptions (CUDA's uncorrectable ECC
error, an NCCL ``DistBackendError``) are still device failures, survived.

Each case is the project's HF example (examples/hf_llama) with one edit, as a user
would make it."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters"))
from test_torch_native_launch import BIN, COMMITTED, _finish, _kill_groups, _run, _start  # noqa: E402

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_llama"
INIT = "    trainer = initialize(\n"
LOOP = "    while (loss := trainer.train_batch()) is not None:  # None: the job ended\n"


def _example(dst: Path, edit: tuple[str, str] | None = None, iterations: int = 8, processes: int = 4) -> Path:
    """The example in ``dst``, ``edit`` applied to train.py. ``processes``: 2 runs it as
    PP2 x DP1, one worker per node, where a test's point needs no replica to survive
    (each worker's start-up is most of such a test's CPU time)."""
    dst.mkdir()
    for f in ("accelerate.yaml", "train.py", "hf_model.py", "README.md", "resihp.toml"):
        shutil.copy(EXAMPLE / f, dst / f)
    if processes != 4:
        yaml = (dst / "accelerate.yaml").read_text()
        assert "\nnum_processes: 4\n" in yaml
        (dst / "accelerate.yaml").write_text(yaml.replace("\nnum_processes: 4\n", f"\nnum_processes: {processes}\n"))
    toml = (dst / "resihp.toml").read_text().replace("iterations = 8", f"iterations = {iterations}")
    (dst / "resihp.toml").write_text(toml.replace("checkpoint_every = 1", "checkpoint_every = 0"))
    if edit is not None:
        text = (dst / "train.py").read_text()
        assert edit[0] in text, edit[0]
        (dst / "train.py").write_text(text.replace(edit[0], edit[1], 1))
    return dst


def _launch(ex: Path, work: Path, *extra: str, timeout: float = 240) -> tuple[int, str, float]:
    t0 = time.monotonic()
    rc, out = _run([str(BIN / "resihp"), "launch", "--config_file", "accelerate.yaml", "--workdir", str(work),
                    "--timeout", str(timeout - 40), *extra, "train.py"], ex, timeout)
    return rc, out, time.monotonic() - t0


def _line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _assert_job_error(rc: int, out: str, code: int, exc: str, where: str) -> None:
    tail = "\n".join(out.strip().splitlines()[-5:])
    assert rc == code, out[-4000:]
    assert exc in tail and where in tail, tail
    assert "full traceback: " in tail, tail
    assert "fail-stop" not in out and "PlannerError" not in out, out[-4000:]


MODEL = "tiny_model(a.model),"
# (name, edit of train.py, exception): each raised before training starts
SETUP_MISTAKES = [
    ("no_split", (MODEL, "torch.nn.Sequential(torch.nn.Linear(4, 4)),"), "TypeError"),
    ("dropout", (MODEL, "tiny_model(a.model).train() if setattr(torch, '_x', 0) else _dropped(tiny_model(a.model)),"),
     "ValueError"),
    ("never_initialized", (INIT, "    print('my own way')\n    return\n" + INIT), "NeverInitialized"),
]
DROPPED = "def _dropped(model):\n    model.config.attention_dropout = 0.1  # GPT-2's default is 0.1\n    return model\n\n\n"


@pytest.mark.timeout(900)
def test_setup_mistakes_end_the_job_with_the_users_exception(tmp_path):
    """A model ResiHP cannot split, a model with dropout it refuses, a script that
    never calls initialize(): exit 2 (before training), the exception on the console.
    Two workers: every rank raises the same mistake. The three launches run at once
    (each is mostly one process at a time: launcher, imports, teardown)."""
    procs, t0 = {}, time.monotonic()
    try:
        for name, edit, _ in SETUP_MISTAKES:
            ex = _example(tmp_path / name, edit, processes=2)
            text = (ex / "train.py").read_text()
            (ex / "train.py").write_text(text.replace("def main() -> None:", DROPPED + "def main() -> None:"))
            procs[name] = _start([str(BIN / "resihp"), "launch", "--config_file", "accelerate.yaml", "--workdir",
                                  str(tmp_path / f"work-{name}"), "--timeout", "200", "train.py"], ex)
        for name, edit, exc in SETUP_MISTAKES:
            rc, out = _finish(procs[name], 240)
            seconds = time.monotonic() - t0
            _assert_job_error(rc, out, 2, exc, f"at {tmp_path / name / 'train.py'}")
            assert seconds < 120, (name, seconds)  # ends promptly (the start-up is most of it)
            assert (tmp_path / f"work-{name}" / "events.json").exists()
    finally:
        _kill_groups(list(procs.values()))


@pytest.mark.timeout(600)
def test_an_exception_in_the_users_loop_on_one_rank_ends_the_job(tmp_path):
    raise_at = "        if os.environ.get('RANK') == '1' and trainer.iteration == 5:\n            raise ValueError('my bug')\n"
    ex = _example(tmp_path / "ex", (LOOP, LOOP + raise_at), processes=2)  # rank 1 raises, rank 0 does not
    rc, out, _ = _launch(ex, tmp_path / "work")
    _assert_job_error(rc, out, 3, "ValueError: my bug", f"train.py:{_line_of(ex / 'train.py', 'my bug')}")
    assert "at iteration 5" in out, out[-2000:]
    log = (tmp_path / "work" / "run.log").read_text()
    assert "Traceback (most recent call last)" in log and "raise ValueError('my bug')" in log


@pytest.mark.timeout(600)
def test_a_loop_that_ends_early_ends_the_job_normally(tmp_path):
    ex = _example(tmp_path / "ex", (LOOP, LOOP + "        if trainer.iteration == 4:\n            break\n"), processes=2)
    rc, out, _ = _launch(ex, tmp_path / "work")
    assert rc == 0, out[-4000:]
    assert "loop ended after 4 of 8 configured iterations" in out, out[-2000:]
    assert "failure" not in out, out[-4000:]


@pytest.mark.timeout(600)
def test_device_kind_exceptions_are_survived_as_device_failures(tmp_path):
    """What CUDA raises for an uncorrectable ECC error on device 1, and an NCCL
    DistBackendError on device 3 (replica 1, both): each is a fail-stop of its device,
    the job trains on replica 0 and every iteration commits."""
    ex = _example(tmp_path / "ex")
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps([{"device": 1, "iteration": 3, "kind": "ecc"},
                                  {"device": 3, "iteration": 3, "kind": "nccl"}]))
    rc, out, _ = _launch(ex, tmp_path / "work", "--faults", str(faults))
    assert rc == 0, out[-4000:]
    lost = {int(d) for ds in re.findall(r"failure: fail-stop of devices \[([\d, ]+)\]", out) for d in ds.split(", ")}
    assert lost == {1, 3}, out[-4000:]
    assert sorted(int(i) for i, _ in COMMITTED.findall(out)) == list(range(8)), out[-3000:]
    assert "job_error" not in out
