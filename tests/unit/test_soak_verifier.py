"""The soak's step-by-step verifier (benchmarks/soak.py): it passes a correct run's
checkpoints, bridges an incomplete one, names the first wrong step or loss, goes back
to the restored checkpoint when the job re-trains, and deletes what it verified."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak  # noqa: E402
from resihp_adapters.megatron_ref.reference import reference_trajectory  # noqa: E402
from resihp_adapters.megatron_ref.state import component_of  # noqa: E402
from resihp_adapters.torchkit.checkpoint import save_component, write_manifest  # noqa: E402

N = 6


@pytest.fixture
def run(tmp_path: Path):
    """A soak whose 'job' committed N iterations: checkpoints and losses of a fault-free run."""
    s = soak.Soak(2, 0, tmp_path / "work")
    s.ckpt = tmp_path / "ckpt"
    s.job = types.SimpleNamespace(committed=N, committed_in={})
    states = {}
    for it, loss, st in reference_trajectory(s.model, s.data, N, lr=s.lr):
        write(s.ckpt, it, st)
        s.losses[it] = loss
        states[it] = st
    return s, states


def write(root: Path, it: int, state: dict) -> None:
    comps: dict[str, dict] = {}
    for name, ts in state.items():
        comps.setdefault(component_of(name), {})[name] = ts
    for c, full in comps.items():
        save_component(root, it, c, full)
    write_manifest(root, it, comps)


def test_a_correct_run_verifies_every_iteration(run) -> None:
    s, _ = run
    s.advance()
    assert s.problems == []
    assert s.verified[0] == N - 1 and s.checked == set(range(N))
    assert s.accounting["loss_checks"] == N and s.accounting["worst_step_error"] < 1e-12


def test_an_incomplete_checkpoint_is_bridged(run) -> None:
    s, _ = run
    (s.ckpt / "iter00000002" / "manifest.json").unlink()
    s.advance()
    assert s.problems == [] and s.checked == set(range(N))


def test_the_first_wrong_step_is_named(run) -> None:
    s, states = run
    bad = {k: tuple(t.clone() for t in v) for k, v in states[3].items()}
    bad["layers.1.wq.weight"][0].mul_(1 + 1e-6)
    write(s.ckpt, 3, bad)
    s.advance()
    assert s.problems and s.problems[0].startswith("checkpoint 3 ")
    assert "layers.1.wq.weight param" in s.problems[0]


def test_a_wrong_loss_is_named(run) -> None:
    s, _ = run
    s.losses[4] *= 1 + 1e-6
    s.advance()
    assert len(s.problems) == 1 and s.problems[0].startswith("iteration 4 ")
    assert s.accounting["loss_failures"] == 1


def test_a_restore_sends_the_verifier_back(run) -> None:
    s, _ = run
    s.advance()
    shutil.rmtree(s.ckpt / "iter00000004")  # re-trained after the restore: not written yet
    s.job.committed = 4
    s.on_event({"kind": "plan", "resume": 2, "iteration": 2, "generation": 1, "text": "restore (x, y)"})
    s.advance()
    assert s.verified[0] == 3 and s.problems == []


def test_verified_checkpoints_are_deleted_but_the_newest_kept(run, monkeypatch) -> None:
    s, _ = run
    monkeypatch.setattr(soak, "BEHIND", 2)
    s.advance()
    left = sorted(p.name for p in s.ckpt.iterdir())
    assert left == [f"iter{k:08d}" for k in range(N - 1 - 2, N)]
    assert s.worst_between(0, N - 1) is not None and s.worst_between(0, N) is None
