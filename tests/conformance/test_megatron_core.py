"""The conformance kit on the megatron_core adapter: a GPTModel (tied embedding and
output layer) with Megatron's DDP, optimizer and parameter scheduler, run by Megatron's
own 1F1B, passes every scenario its capabilities call for. The built-in job in float64
(no clipping: Megatron's clipping takes float32 only) holds every scenario to 1e-9 of
the fault-free run; float32 differs by summation order only (about 4e-5 relative on the
near-zero biases after the Adam updates, measured)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")

from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_core.testing.conformance import check_adapter  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _job(dp: int, nmb: int) -> JobSpec:
    return JobSpec(adapter="megatron_core", adapter_config={"dtype": "float64"}, data={"source": "synthetic"},
                   dp=dp, num_microbatches=nmb, seed=5, timeout_s=20.0)


def test_megatron_core_pp2_dp2_repartition_migration_and_restore():
    """PP2 x DP2 (for the CI budget, regeneration runs in the TP2 test below, and a
    replica dropped after a SIGKILL in the opt-in 8-worker test of
    tests/integration/test_megatron_core.py; the kit's ``replica_drop`` here gave 1.6e-13
    by hand): one layer moved between stages (a new ``pipeline_model_parallel_layout``), replica 1's last
    micro-batch run whole on replica 0 (pipelines of 3 and 1 micro-batches), and a
    SIGKILLed device restored by the supervisor from the adapter's checkpoint onto the
    surviving replica; the complete state (parameters, Adam moments and step, learning
    rate, scheduler position) equals the fault-free run."""
    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)
    want = {"layer_repartition", "migration", "restore"}
    # Two kit runs at once, the restore first: in it the surviving replica's stage-0 rank
    # waits out the 20 s op timeout on a recv whose peer left (CPU idle meanwhile).
    got = check_adapter(_job(2, 2), base, only=sorted(want), timeout=600.0, jobs=2)
    assert set(got) == want
    assert max(got.values()) <= 1e-9


def test_megatron_core_tp2_regeneration_and_tp_resize():
    """TP2 x PP1 x DP1: the same plan again mid-iteration (rollback, nothing re-sharded),
    then TP2 -> TP1: the departing TP rank, a standby of the new plan, sends its shards in
    a world of every device before Megatron's world of the executors is built; every
    parameter and Adam moment (QKV, the vocab-parallel embedding and the tied output
    layer included) equals the fault-free TP2 run's."""
    base = ParallelPlan.uniform(tp=2, pp=1, dp=1, num_layers=4, num_microbatches=2)
    got = check_adapter(_job(1, 2), base, only=["regeneration", "tp_resize"], timeout=600.0, tol=1e-6)
    assert set(got) == {"regeneration", "tp_resize"}
    assert got["regeneration"] <= 1e-9
    # After the change TP1 sums what TP2 summed in two partial products plus an
    # all-reduce: float64 rounding, amplified by Adam on near-zero biases (3e-8 measured).
    # A wrong shard would be off by O(1).
    assert got["tp_resize"] <= 1e-6


@pytest.mark.skipif(os.environ.get("RESIHP_MEGATRON_CORE_DISTOPT") != "1",
                    reason="7 kit runs of 4 workers (about 9 min on 2 loaded cores): set RESIHP_MEGATRON_CORE_DISTOPT=1")
def test_megatron_core_distributed_optimizer_pp2_dp2():
    """PP2 x DP2 with Megatron's distributed optimizer (float32: it casts main gradients
    to float32), every scenario the adapter declares. The kit also checks that the
    replicas of a stage hold the same complete state, Adam moments included, which only
    the adapter's gathered moments give (each DP rank updates its own range). Regeneration
    equals the fault-free run exactly; layer repartition and migration show the very
    error the plain Megatron optimizer shows in the same scenario (float32 summation
    order of the changed layout, equal to 1e-6); the SIGKILLed replica's drop and the
    restore land on a timing-dependent iteration, so they are held to 1e-3 (4.9e-5 to
    1.6e-4 seen, the plain optimizer's range), where a lost or misplaced moment shard
    would be off by O(1)."""
    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)
    names = ["regeneration", "layer_repartition", "migration", "replica_drop", "slow_drop", "restore"]
    ordered = ["layer_repartition", "migration"]

    def kit(dist_opt: bool, only: list[str]) -> dict[str, float]:
        job = JobSpec(adapter="megatron_core", adapter_config={"distributed_optimizer": dist_opt},
                      data={"source": "synthetic"}, dp=2, num_microbatches=2, seed=5, timeout_s=20.0)
        return check_adapter(job, base, only=only, timeout=600.0, tol=1e-3)

    got, plain = kit(True, names), kit(False, ordered)
    assert set(got) == set(names)
    assert got["regeneration"] == 0.0
    for name in ordered:
        assert got[name] == pytest.approx(plain[name], rel=1e-6, abs=1e-12), name
