"""Chaos matrix on the whole runtime: real workers, node agents, controller, Scheduler and
supervisor. Each scenario injects faults with ``fail_at`` and checks that the job
finishes every iteration and that every surviving worker's parameters and optimizer
state equal the fault-free single-process run (float64)."""

from __future__ import annotations

from pathlib import Path

import pytest

from resihp_core.config import DetectorConfig
from resihp_core.plan import Topology
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
from resihp_core.runtime.resilient import run_resilient
from resihp_core.scheduler.planner import Planner
from resihp_core.scheduler.state import PlannerState
from resihp_adapters.megatron_ref.plugin import CAPABILITIES
from resihp_plugins.faults import fail_at

from .backend_harness import Finished, check_against_reference, job_spec, tmpdir, uniform

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DETECTOR = DetectorConfig(heartbeat_interval_s=0.05, heartbeat_miss_limit=6, hang_min_timeout_s=20.0,
                          warmup_iterations=3, min_changepoint_gap=3)


def _planner_state(plan, topology):
    corpus = CorpusSpec(scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64)
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8,
                                       ref_layers=plan.layers(0), ref_tp=1), plan.pp)
    pred = IterationPredictor(cost, topology, ModelShape(tokens=64, hidden=32, params_per_layer=10_000),
                              LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9))
    feats = workload_features(iteration_workload(corpus, 0, plan.dp, plan.num_microbatches),
                              plan.dp, plan.num_microbatches)
    return PlannerState.create(topology, plan, pred, feats, capabilities=CAPABILITIES), Planner(capabilities=CAPABILITIES)


def _chaos(plan, faults, iterations=6):
    import os

    import torch

    topology = Topology.uniform(2, len(plan.devices()) // 2)  # exactly the workers we start
    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir(),
                    checkpoint_dir=tmpdir(), checkpoint_every=1,
                    faults=[f.to_dict() for f in faults])
    state, planner = _planner_state(plan, topology)
    run = run_resilient(spec.to_json(), plan, topology, state, planner, DETECTOR, iterations,
                        Path(tmpdir()), timeout=240)
    assert run.ok, f"{run.error}; logs in {run.logs}"
    assert len(run.records) == iterations
    dumps = {int(f[6:-3]): torch.load(os.path.join(spec.dump_dir, f), weights_only=False)
             for f in os.listdir(spec.dump_dir)}
    # Accounting comes from the job store of the supervised run; the harness checks
    # parameters and optimizer state of every survivor against the reference.
    done = Finished(spec, dumps, [r.loss for r in run.records], [])
    check_against_reference(done, iterations)
    return run


def test_kill_one_tp_member_and_a_whole_tp_group_of_another_replica():
    plan = uniform(2, 2, 2, 3)
    member = plan.group(0, 1)[1]
    group = plan.group(1, 0)
    run = _chaos(plan, [fail_at(member, 2, "kill"), fail_at(group[0], 4, "kill"), fail_at(group[1], 4, "kill")])
    assert any(e["kind"] == "plan" and e["generation"] >= 1 for e in run.events)


def test_last_replica_of_a_stage_lost_restores_from_checkpoint():
    plan = uniform(1, 2, 2, 3)
    stage1 = [plan.group(0, 1)[0], plan.group(1, 1)[0]]
    run = _chaos(plan, [fail_at(d, 3, "kill") for d in stage1])
    assert any("restore" in e["text"] for e in run.events if e["kind"] == "plan")


def test_stopped_worker_is_fenced_and_the_job_goes_on():
    plan = uniform(1, 2, 2, 3)
    run = _chaos(plan, [fail_at(plan.group(1, 1)[0], 3, "stop")])
    failures = [e for e in run.events if e["kind"] == "failure"]
    assert failures and failures[0]["failure"] == "fail-stop"
