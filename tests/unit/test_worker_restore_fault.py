"""A checkpoint that turns bad between the supervisor's verification and a worker's load
is the storage's fault, whatever the framework raises on reading it; a load that fails
on a checkpoint that still verifies is the job's (docs/checkpoints.md, the restore rule)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from resihp_core import checkpoints  # noqa: E402
from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.runtime import session  # noqa: E402
from resihp_core.runtime.store import LocalStore, _Table  # noqa: E402
from resihp_core.runtime.worker import Worker  # noqa: E402

from tests.unit.test_worker_check_move import TP2_PP2, Recording, _update  # noqa: E402


class Unreadable(Recording):
    """Loads fail as a framework's reader fails on bytes it cannot parse (a RuntimeError,
    not an OSError: torch.load's, or torchkit's ``CheckpointError``)."""

    def load_checkpoint(self, iteration, plan):
        raise RuntimeError(f"PytorchStreamReader failed reading zip archive (iteration {iteration})")


def _restore(tmp_path, corrupt: bool) -> tuple[Worker, LocalStore]:
    d = checkpoints.iteration_dir(tmp_path, 9)
    d.mkdir(parents=True)
    (d / "state.pt").write_bytes(b"the state after iteration 9")
    checkpoints.seal(tmp_path, 9)
    if corrupt:  # after the supervisor verified it, before this worker reads it
        (d / "state.pt").write_bytes(b"the state after iteration 9, changed")
    store = LocalStore(_Table(), timeout_s=5.0)
    w = Worker(0, store, JobSpec(adapter="recording", timeout_s=1.0, checkpoint_dir=str(tmp_path)),
               factory=Unreadable)
    w.plan = TP2_PP2
    return w, store


def test_a_checkpoint_spoiled_after_verification_is_a_storage_fault_not_the_jobs_error(tmp_path):
    w, store = _restore(tmp_path, corrupt=True)
    assert w._reconfigure(_update(TP2_PP2, (0, 1, 2, 3), restore=9, resume=10)) is False
    left = session.get_left(store, 1, 0)
    assert left is not None and left.state_lost, "the supervisor must restore again"
    assert "SHA-256 mismatch" in left.reason and "state.pt" in left.reason, left.reason


def test_a_load_that_fails_on_a_checkpoint_that_still_verifies_ends_the_job(tmp_path):
    w, store = _restore(tmp_path, corrupt=False)
    w.msg = msg = _update(TP2_PP2, (0, 1, 2, 3), restore=9, resume=10)  # as _enter_next sets it
    with pytest.raises(RuntimeError, match="PytorchStreamReader"):
        w._reconfigure(msg)
    assert session.get_left(store, 1, 0) is None
