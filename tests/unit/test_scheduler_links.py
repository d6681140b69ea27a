"""A slow host link (every device of a node reported with cause ``communication``): the
evaluator slows only traffic that leaves the node, the planner places the layout so
that less crosses it where the adapter can move state, and says plainly what still
crosses it and why (scheduler/links.py, docs/detector.md "Slow links"). Plans only,
no processes."""

from __future__ import annotations

from dataclasses import replace

from resihp_core.adapter import Capabilities
from resihp_core.plan import ParallelPlan, ScheduleKind, Topology
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
from resihp_core.predictor.predict import (
    IterationPredictor,
    ModelShape,
    workload_features,
)
from resihp_core.protocol import FailureReport
from resihp_core.scheduler.links import crossings
from resihp_core.scheduler.planner import Planner
from resihp_core.scheduler.state import PlannerState

SCHEDULES = frozenset({ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B})
# torch_native's kind: re-stages (state moved by global layer index), whole micro-batches move.
RESTAGE = Capabilities(tp_resize=True, heterogeneous_tp=True, layer_repartition=True, uneven_dp=True,
                       schedules=SCHEDULES, checkpoint=True, restage=True)
# megatron_ref's kind: migrates work and repartitions layers, but does not re-stage.
MIGRATE = Capabilities(tp_resize=True, heterogeneous_tp=True, layer_repartition=True,
                       cross_replica_migration=True, schedules=SCHEDULES, checkpoint=True)
BY_STAGE = (((0,), (2,)), ((1,), (3,)))  # stage 0 on node 0, stage 1 on node 1: boundaries cross
BY_REPLICA = (((0,), (1,)), ((2,), (3,)))  # replica 0 on node 0, replica 1 on node 1: reductions cross


def state(caps: Capabilities, groups=BY_STAGE, *, tokens: int = 4096, hidden: int = 1024,
          params: int = 10_000) -> PlannerState:
    """PP2 x DP2 on two hosts of two devices: large activations and a small model by
    default (pipeline boundaries carry most bytes), ``params`` per layer for the DP
    reduction."""
    topology = Topology.uniform(2, 2)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4).with_(tp_groups=groups)
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8,
                                       ref_layers=2, ref_tp=1), 2)
    pred = IterationPredictor(cost, topology, ModelShape(tokens=tokens, hidden=hidden, params_per_layer=params),
                              LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9))
    corpus = CorpusSpec(scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64)
    feats = workload_features(iteration_workload(corpus, 0, 2, 4), 2, 4)
    return PlannerState.create(topology, plan, pred, feats, capabilities=caps)


def link(p: float = 0.05, devices: tuple[int, ...] = (2, 3)) -> FailureReport:
    return FailureReport(generation=0, failure="fail-slow", devices=devices, cause="communication",
                         throughput={d: p for d in devices})


def test_a_hosts_link_slows_only_the_traffic_that_leaves_the_host() -> None:
    healthy = state(RESTAGE)
    slow = healthy.with_health(link_speeds={2: 0.05, 3: 0.05})  # every device of node 1: its interface
    assert slow.evaluator.node_links == {1: 0.05} and slow.evaluator.device_links == {}
    by_replica = healthy.plan.with_(tp_groups=BY_REPLICA)
    # Boundaries inside the hosts: only the (small) DP reduction crosses the slow link.
    assert slow.evaluator.time(by_replica) < 1.1 * healthy.evaluator.time(by_replica)
    # Boundaries across it: every micro-batch's activations cross it, twice as slow or worse.
    assert slow.evaluator.time(healthy.plan) > 1.4 * healthy.evaluator.time(healthy.plan)
    assert crossings(slow.evaluator, by_replica, 1) == ["the DP reduction of stage 0", "the DP reduction of stage 1"]
    # One device's own link (not its whole node) still slows every transfer it takes part in.
    one = healthy.with_health(link_speeds={3: 0.05})
    assert one.evaluator.node_links == {} and one.evaluator.device_links == {3: 0.05}
    assert one.evaluator.time(by_replica) > 1.4 * healthy.evaluator.time(by_replica)


def test_pipeline_boundaries_move_off_a_slow_host_link_when_the_adapter_can_move_state() -> None:
    st = state(RESTAGE)
    d = Planner().plan(st, link())
    ev = d.state.evaluator
    # Each replica now on one host: no pipeline boundary crosses the link, only the DP reductions.
    assert all(len({ev.node_of(x) for g in rep for x in g}) == 1 for rep in d.plan.tp_groups), d.plan.tp_groups
    assert not [c for c in crossings(ev, d.plan, 1) if "pipeline" in c]
    assert d.predicted_time < 0.8 * ev.time(st.plan)
    assert "traffic moved off the link of node 1 (devices [2, 3], 0.05 of its bandwidth) by place-replicas, " \
           "leaving the DP reduction of stage 0, the DP reduction of stage 1 across it" in d.reason, d.reason


def test_a_slow_hosts_devices_stand_by_when_no_layout_using_them_is_faster() -> None:
    # A large model on a slow link: every layout that uses both hosts reduces its
    # gradients (or passes activations) across it; one replica on the healthy host wins.
    st = state(RESTAGE, tokens=64, hidden=32, params=10_000_000)
    d = Planner().plan(st, link(0.01))
    assert not {2, 3} & set(d.plan.devices()) and {2, 3} <= set(d.plan.standbys), d.plan
    assert d.plan.dp * d.plan.num_microbatches == 8  # the same global batch
    assert "traffic moved off the link of node 1 (devices [2, 3], 0.01 of its bandwidth)" in d.reason
    assert "its devices stand by" in d.reason, d.reason


def test_a_dp_replica_on_the_slow_host_is_dropped_by_an_adapter_that_migrates_work() -> None:
    # Replicas already one per host: the DP reduction is what crosses the link, and
    # dropping the slow host's replica (its micro-batches run on the other) is faster.
    st = state(MIGRATE, BY_REPLICA, tokens=64, hidden=32, params=10_000_000)
    d = Planner().plan(st, link(0.01))
    assert d.plan.group(1, 0) == () and d.plan.group(1, 1) == () and d.plan.migrations, d.plan
    assert "traffic moved off the link of node 1" in d.reason and "its devices stand by" in d.reason, d.reason


def test_a_slow_host_link_that_cannot_be_moved_off_is_said_plainly() -> None:
    # Every replica has a stage on each host and the adapter cannot move stages between
    # devices: the plan keeps its layout, and the reason names the link, what crosses it, why.
    st = state(MIGRATE)
    d = Planner().plan(st, link())
    assert d.plan.tp_groups == st.plan.tp_groups
    assert ("the link of node 1 (devices [2, 3], 0.05 of its bandwidth) still carries the pipeline boundary of "
            "replica 0 between stages 0 and 1, the pipeline boundary of replica 1 between stages 0 and 1: "
            "the adapter cannot move stages between devices") in d.reason, d.reason
    # Every host's link slow alike: no layout on more than one host avoids them.
    d = Planner().plan(st, link(0.05, (0, 1, 2, 3)))
    assert d.plan.tp_groups == st.plan.tp_groups
    assert d.reason.count("every node the plan uses has a slow link") == 2, d.reason
    # ... though an adapter that moves state still keeps the pipeline boundaries inside them.
    d = Planner().plan(replace(st, capabilities=RESTAGE), link(0.05, (0, 1, 2, 3)))
    assert d.plan.tp_groups == BY_REPLICA and "by place-replicas" in d.reason, d.reason
