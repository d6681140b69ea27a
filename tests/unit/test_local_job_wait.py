"""``LocalJob.wait`` (the conformance kit's and the tests' job without a supervisor) says
at once when every device gave the generation up, with each device's reason, instead of
waiting out its timeout for a commit that cannot come."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

import pytest

from resihp_core.job import JobSpec
from resihp_core.plan import ParallelPlan
from resihp_core.protocol import WorkerLeft
from resihp_core.runtime import session
from resihp_core.runtime.controller.launcher import LocalJob, NoProgress


class Absent:
    """A process host whose workers never run (their store keys are written by the test)."""

    def __init__(self, workdir: Path) -> None:
        self.devices: list[int] = []

    def launch(self, devices: Iterable[int], **kw: object) -> None:
        self.devices = sorted(devices)

    def alive(self) -> list[int]:
        return list(self.devices)

    def dead(self) -> list[int]:
        return []

    def signal(self, device: int, sig: int) -> None:
        pass

    def kill(self, device: int, *, wait: bool = True) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


def _job() -> LocalJob:
    spec = JobSpec(adapter="megatron_ref", dp=2, num_microbatches=2)
    lj = LocalJob(spec.to_json(), [0, 1], processes=Absent)
    lj.post(ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=2, num_microbatches=2), iterations=3)
    return lj


def test_every_device_leaving_the_generation_ends_the_wait_with_their_reasons():
    with _job() as lj:
        for d in (0, 1):
            session.put_left(lj.store, WorkerLeft(generation=lj.generation, device=d, error="StateLost",
                                                  reason=f"StateLost: shard {d}/2 was held only by dead devices",
                                                  state_lost=True))
        t = time.monotonic()
        with pytest.raises(NoProgress, match=r"every device left generation \d+: device 0: StateLost: shard 0/2 .*"
                                             r"device 1: StateLost: shard 1/2"):
            lj.wait(1, timeout=60.0)
        assert time.monotonic() - t < 10.0


def test_one_device_leaving_is_waited_out_as_before():
    with _job() as lj:
        session.put_left(lj.store, WorkerLeft(generation=lj.generation, device=1, reason="RuntimeError: peer gone"))
        with pytest.raises(NoProgress, match="did not commit in 1s"):
            lj.wait(1, timeout=1.0)
