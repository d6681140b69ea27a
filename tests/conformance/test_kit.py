"""The conformance kit on real adapters: the reference backend and the example custom
adapter pass it for what they declare; an adapter that declares a capability it does not
have fails it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from resihp_core.job import JobSpec
from resihp_core.plan import ParallelPlan
from resihp_core.testing.conformance import ConformanceError, check_adapter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "custom_adapter")
ENV = {"PYTHONPATH": EXAMPLE + ":" + str(Path(__file__).resolve().parent)}
sys.path[:0] = ENV["PYTHONPATH"].split(":")  # the kit reads the adapters' capabilities here too


def _example_job(adapter: str) -> JobSpec:
    return JobSpec(adapter=adapter, adapter_config={"lr": 0.05}, dp=2, num_microbatches=2, seed=3)


def test_example_adapter_passes_for_what_it_declares():
    base = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=1, num_microbatches=2)
    got = check_adapter(_example_job("resihp_example_adapter.adapter:ExampleAdapter"), base, env=ENV)
    assert set(got) == {"regeneration", "migration", "replica_drop", "restore"}
    assert max(got.values()) <= 1e-12


def test_a_declared_capability_the_adapter_lacks_fails_the_kit():
    base = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=1, num_microbatches=2)
    with pytest.raises(ConformanceError, match=r"migration: .*(accounting|differs|loss)"):
        check_adapter(_example_job("liar:SkipsMigrated"), base, env=ENV, only=["migration"])


def test_reference_backend_passes():
    job = JobSpec(adapter="megatron_ref",
                  adapter_config=dict(vocab_size=64, hidden=32, num_heads=4, ffn_hidden=64, num_layers=4,
                                      dtype="float64"),
                  data=dict(source="synthetic", scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64),
                  dp=2, num_microbatches=2)
    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2, num_heads=4)
    got = check_adapter(job, base)
    assert {"regeneration", "layer_repartition", "migration", "replica_drop", "restore"} <= set(got)
    assert max(got.values()) <= 1e-9
