"""Job errors are not device failures (docs/errors.md): the one classification table,
the user's file:line, and the supervisor ending the job on a job error (after a grace
period in which a device failure would explain it) without planning anything."""

from __future__ import annotations

import pytest

from resihp_core import errors
from resihp_core.errors import classify, register_device_error, user_frame
from resihp_core.protocol import FailureReport, JobError, ScriptEnded, decode, encode
from resihp_core.runtime.controller.supervisor import (JOB_ERROR_GRACE_S, EndJob, Emit, Finish, NotifyFailure, PlanFailure)

from test_supervisor import Clock, running, tick  # the same job and clock

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("exc", [
    torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error"),
    torch.distributed.DistNetworkError("Connection reset by peer"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    getattr(torch, "AcceleratorError", RuntimeError)("CUDA error: uncorrectable ECC error encountered"),
    ConnectionResetError("peer gone"),
    TimeoutError("store wait"),
])
def test_device_and_communication_faults_are_device_failures(exc: BaseException) -> None:
    assert classify(exc) == "device"


@pytest.mark.parametrize("exc", [
    ValueError("my own bug"),
    TypeError("GPT2LMHeadModel has no split"),
    KeyError("labels"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
    RuntimeError("CUDA error: device-side assert triggered"),  # an index out of range in the user's model
    AssertionError("my invariant"),
])
def test_the_jobs_own_exceptions_are_job_errors(exc: BaseException) -> None:
    assert classify(exc) == "job"


def test_a_device_fault_anywhere_in_the_chain_counts() -> None:
    try:
        try:
            raise torch.distributed.DistBackendError("NCCL communicator was aborted")
        except Exception as inner:
            raise ValueError("while reducing gradients") from inner
    except ValueError as e:
        assert classify(e) == "device"


def test_the_user_extends_the_table(monkeypatch) -> None:
    monkeypatch.setattr(errors, "_user_types", [])
    monkeypatch.setattr(errors, "_user_text", [])

    class MyFabricError(Exception):
        pass

    assert classify(MyFabricError("link flap")) == "job"
    register_device_error(MyFabricError)
    register_device_error(r"XID \d+")
    assert classify(MyFabricError("link flap")) == "device"
    assert classify(RuntimeError("GPU fell off the bus: XID 79")) == "device"
    with pytest.raises(TypeError, match="exception class or a regular expression"):
        register_device_error(42)  # type: ignore[arg-type]


def test_user_frame_names_the_users_own_line() -> None:
    def users_code() -> None:
        raise ValueError("boom")

    try:
        users_code()
    except ValueError as e:
        where = user_frame(e)
    assert where.endswith(f"test_errors.py:{users_code.__code__.co_firstlineno + 1}"), where


def test_job_error_travels_as_a_typed_message() -> None:
    e = JobError(device=1, exc_type="ValueError", message="boom\nsecond line", where="/x/train.py:46",
                 phase="training", iteration=3, generation=0)
    assert decode(encode(e)) == e
    assert e.line() == "ValueError: boom (at /x/train.py:46, device 1)"


def _error(device: int = 1) -> JobError:
    return JobError(device=device, exc_type="ValueError", message="boom", where="/x/train.py:46", iteration=3)


def test_a_job_error_ends_the_job_and_plans_nothing() -> None:
    clock = Clock()
    sup = running(clock)
    assert sup.handle(_error()) == []
    # The worker exited with its job-error status: not a failure, nothing planned.
    assert sup.handle(tick(alive=(0, 2, 3), dead=(1,))) == []  # within the grace period
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(1,), evidence="connection closed"))
    clock.now += JOB_ERROR_GRACE_S + 0.1
    actions = sup.handle(tick(alive=(0, 2, 3), dead=(1,)))
    assert [type(a) for a in actions] == [Emit, EndJob], actions
    assert actions[0].kind == "job_error" and "ValueError: boom (at /x/train.py:46" in actions[0].text
    assert actions[1].error.device == 1
    assert not any(isinstance(a, (NotifyFailure, PlanFailure)) for a in actions)


def test_a_job_error_that_follows_a_device_failure_is_that_failure() -> None:
    """A peer's death can surface on a survivor as an odd exception: a device failure
    within the grace period means the job goes on, the erring device lost with it."""
    clock = Clock()
    sup = running(clock)
    sup.handle(_error(device=1))
    actions = sup.handle(tick(alive=(0, 1), dead=(2, 3)))
    assert any(isinstance(a, PlanFailure) for a in actions), actions
    assert not any(isinstance(a, EndJob) for a in actions)


def test_a_script_that_ended_ends_the_job_normally() -> None:
    sup = running()
    sup.handle(ScriptEnded(device=2, iteration=4))
    actions = sup.handle(tick(alive=(0, 1, 3), dead=(2,)))
    assert [type(a) for a in actions] == [Finish] and actions[0].ended.iteration == 4
