"""The conformance kit on real adapters: the reference backend and the example custom
adapter pass it for what they declare; an adapter that declares a capability it does not
have fails it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from resihp_core.job import JobSpec
from resihp_core.plan import ParallelPlan
from resihp_core.testing.conformance import ConformanceError, check_adapter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "custom_adapter")
HERE = str(Path(__file__).resolve().parent)
# The workers import the example and the liars; the rest of the path is kept as it is.
ENV = {"PYTHONPATH": ":".join(p for p in (EXAMPLE, HERE, os.environ.get("PYTHONPATH", "")) if p)}
sys.path[:0] = [EXAMPLE, HERE]  # the kit reads the adapters' capabilities here too


def _example_job(adapter: str) -> JobSpec:
    return JobSpec(adapter=adapter, adapter_config={"lr": 0.05}, dp=2, num_microbatches=2, seed=3)


EXAMPLE_BASE = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=1, num_microbatches=2)


@pytest.fixture(scope="module")
def example_fault_free():
    """The example adapter's fault-free run, once for the module: it is also
    ``liar:SkipsMigrated``'s (a fault-free plan has no migrated micro-batch, the only
    ones that liar treats differently), which saves a job of worker processes (their
    start-up is most of a conformance run's CPU time)."""
    from resihp_core.testing.conformance import run_scenario

    return run_scenario(_example_job("resihp_example_adapter.adapter:ExampleAdapter"), EXAMPLE_BASE, None, env=ENV)


def test_example_adapter_passes_for_what_it_declares(example_fault_free):
    base = EXAMPLE_BASE
    said: list[str] = []
    got = check_adapter(_example_job("resihp_example_adapter.adapter:ExampleAdapter"), base, env=ENV,
                        progress=said.append, reference=example_fault_free)
    assert set(got) == {"regeneration", "migration", "replica_drop", "slow_drop", "restore"}
    assert max(got.values()) <= 1e-12
    # It reports no full_state(): the kit says it compares held_state() only.
    assert any("does not report full_state()" in line for line in said), said


def test_checkpoints_the_supervisor_cannot_select_fail_the_restore_scenario():
    """The kit's restore scenario (run alone: it fails before any comparison)."""
    from resihp_core.testing.conformance import run_scenario, scenarios
    from resihp_example_adapter.plugin import CAPABILITIES

    base = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=1, num_microbatches=2)
    restore = next(sc for sc in scenarios(CAPABILITIES, base) if sc.name == "restore")
    with pytest.raises(ConformanceError, match=r"restore: the supervisor finds no complete checkpoint.*mine-.*initial state"):
        run_scenario(_example_job("liar:OwnCheckpointLayout"), base, restore, env=ENV)


def test_a_declared_capability_the_adapter_lacks_fails_the_kit(example_fault_free):
    with pytest.raises(ConformanceError, match=r"migration: .*(accounting|differs|loss)"):
        check_adapter(_example_job("liar:SkipsMigrated"), EXAMPLE_BASE, env=ENV, only=["migration"],
                      reference=example_fault_free)


def _reference_job(adapter: str = "megatron_ref") -> JobSpec:
    return JobSpec(adapter=adapter,
                   adapter_config=dict(vocab_size=64, hidden=32, num_heads=4, ffn_hidden=64, num_layers=4,
                                       dtype="float64"),
                   data=dict(source="synthetic", scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64),
                   dp=2, num_microbatches=2)


def test_an_adapter_that_loses_part_of_its_state_fails_the_complete_state_check():
    """Leaving out one optimizer-state tensor, the step count, or the LR scheduler's
    position on a move: the framework's complete state (full_state) differs from the
    fault-free run's. The liars are the reference backend with an LR schedule
    (liar.StepDecay); one fault-free run of it serves all three (what check_adapter
    does per adapter). Two workers (DP2, one stage each) suffice: each liar loses its
    state in ``move_state``, which the regeneration's identity move calls on any
    layout, and the four jobs' worker start-up is most of this test's CPU time."""
    from resihp_core.testing.conformance import _compare, run_scenario, scenarios
    from resihp_adapters.megatron_ref.plugin import CAPABILITIES

    base = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=4, num_microbatches=2, num_heads=4)
    want = run_scenario(_reference_job("liar:StepDecay"), base, None, env=ENV, iterations=3)
    assert want.full is not None and want.full["optimizer.step"] == 3 and want.full["lr_scheduler.last_epoch"] == 3
    regeneration = next(sc for sc in scenarios(CAPABILITIES, base) if sc.name == "regeneration")
    for liar, what in (("liar:DropsOptimizerTensor", r"optimizer\.\S+\.exp_avg_sq|model\."),
                       ("liar:LosesStepOnMove", r"data\.iteration|optimizer\.step"),
                       ("liar:ForgetsScheduleOnMove", r"lr_scheduler\.last_epoch")):
        got = run_scenario(_reference_job(liar), base, regeneration, env=ENV, iterations=3)
        with pytest.raises(ConformanceError, match=rf"regeneration: complete state: ({what})"):
            _compare("regeneration", got, want, base, _reference_job(liar), 1e-9)


def test_reference_backend_passes():
    job = _reference_job()
    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2, num_heads=4)
    said: list[str] = []
    got = check_adapter(job, base, progress=said.append)
    assert not any("full_state" in line for line in said), said  # the complete state was compared
    assert {"regeneration", "layer_repartition", "migration", "replica_drop", "slow_drop", "restore"} <= set(got)
    assert max(got.values()) <= 1e-9


def test_the_kit_refuses_fewer_than_one_run_at_a_time():
    with pytest.raises(ValueError, match="jobs=0"):
        check_adapter(_example_job("resihp_example_adapter.adapter:ExampleAdapter"), EXAMPLE_BASE, env=ENV, jobs=0)
