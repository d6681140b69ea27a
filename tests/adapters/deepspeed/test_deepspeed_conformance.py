"""The conformance kit on the DeepSpeed adapter: every capability it declares (replica
drop with a SIGKILLed replica, layer repartition, DP work migration, restore from a
checkpoint after a kill) ends with the fault-free run's parameters, optimizer state and
losses (float64, <= 1e-9), each micro-batch trained exactly once per iteration."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("deepspeed")

from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_core.testing.conformance import check_adapter  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# The workers import the test model; the rest of the path is kept as it is.
ENV = {"PYTHONPATH": ":".join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p), "OMP_NUM_THREADS": "1"}
sys.path.insert(0, HERE)

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]


def _job() -> JobSpec:
    return JobSpec(adapter="deepspeed", adapter_config={"model": "_model:build", "lr": 1e-3, "num_layers": 6},
                   dp=2, num_microbatches=2, timeout_s=10.0)


@pytest.mark.timeout(900)
def test_deepspeed_adapter_passes_the_kit_for_what_it_declares():
    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=6, num_microbatches=2)
    got = check_adapter(_job(), base, env=ENV, iterations=3)
    assert set(got) == {"regeneration", "layer_repartition", "migration", "replica_drop", "slow_drop", "restore"}
    assert max(got.values()) <= 1e-9
