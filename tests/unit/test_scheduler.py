"""The progressive planner (docs/design.md §4): TP exclusion, PP repartition, DP migration,
escalation, capabilities, plugins — against hand-computed expectations."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from resihp_core.adapter import Capabilities
from resihp_core.hookspecs import hookimpl
from resihp_core.plan import Migration, ParallelPlan, ScheduleKind, ranges_from_counts
from resihp_core.plugins import AdaptationStage, Plugins
from resihp_core.program import check_programs
from resihp_core.protocol import FailureReport
from resihp_core.scheduler import (
    DEFAULT_STAGES,
    MemoryModel,
    Planner,
    PlannerError,
    PlannerState,
    apply_report,
    balance,
    choose_group,
    dp_stage,
    minmax_counts,
    pp_stage,
    tp_stage,
)
from resihp_core.scheduler import builtin as scheduler_builtin
from resihp_core.sim.jobs import TOY_FORWARD_S, job_state, toy_state
from resihp_core.scheduler.tp import drop_stage

F_MS = TOY_FORWARD_S  # one layer of one micro-batch, forward, TP 1 (backward: twice)

DEEPSPEED_LIKE = Capabilities(
    tp_resize=False, heterogeneous_tp=False, layer_repartition=True,
    cross_replica_migration=True, schedules=frozenset({ScheduleKind.ONE_F_ONE_B}), checkpoint=True,
)

tiny = toy_state


def slow(dev: int, p: float, cause: str = "compute") -> FailureReport:
    return FailureReport(generation=0, failure="fail-slow", devices=(dev,), cause=cause,
                         throughput={dev: p})


def stop(*devs: int) -> FailureReport:
    return FailureReport(generation=0, failure="fail-stop", devices=tuple(devs))


def planner() -> Planner:
    return Planner(stages=DEFAULT_STAGES)


def counts(plan: ParallelPlan) -> tuple[int, ...]:
    return tuple(plan.layers(s) for s in range(plan.pp))


# ----------------------------------------------------------------------- TP
def test_tp_tie_keeps_the_larger_degree() -> None:
    # p = {1, 1, 1, 0.5}: k=4 -> 4 x 0.5 = 2, k=2 -> 2 x 1 = 2. Tie -> larger degree.
    st = tiny(tp=4, speeds={3: 0.5})
    assert choose_group(st, 0, 0, [0, 1, 2, 3], (0, 1, 2, 3)) == (0, 1, 2, 3)
    out = tp_stage(st)
    assert out.plan.group(0, 0) == (0, 1, 2, 3) and out.plan.standbys == ()


@pytest.mark.parametrize(
    "speeds,group,standbys",
    [
        ({3: 0.4}, (0, 1), (2, 3)),  # k=4: 1.6 < k=2: 2 -> two healthy, the rest standby
        ({1: 0.9, 3: 0.3}, (0, 2), (1, 3)),  # k=4: 1.2, k=2: 2 (0, 2 at p=1), k=1: 1
        ({0: 0.2, 1: 0.2, 2: 0.2}, (3,), (0, 1, 2)),  # k=4: 0.8, k=2: 0.4, k=1: 1
        ({2: 0.6}, (0, 1, 2, 3), ()),  # k=4: 2.4 > k=2: 2
    ],
)
def test_tp_selective_exclusion_maximises_k_times_min_p(speeds, group, standbys) -> None:
    out = tp_stage(tiny(tp=4, speeds=speeds))
    assert out.plan.group(0, 0) == group
    assert set(out.plan.standbys) == set(standbys)


def test_fail_stop_shrinks_then_standbys_are_drawn_and_rejoin_restores() -> None:
    st = tiny(tp=4, dp=2)
    d1 = planner().plan(st, stop(1))
    assert d1.plan.group(0, 0) == (0, 2) and d1.plan.standbys == (3,)
    assert d1.plan.excluded == {1} and d1.plan.generation == 1
    # A later failure in the same group draws the intra-node standby.
    d2 = planner().plan(d1.state, stop(2))
    assert d2.plan.group(0, 0) == (0, 3) and d2.plan.generation == 2
    # The repaired device rejoins: k=4 is feasible again (2 devices lost: 0,3 + 1 only).
    d3 = planner().rejoin(d2.state, [1, 2])
    assert d3.plan.group(0, 0) == (0, 3, 1, 2) and d3.kind == "continue"
    assert d3.plan.excluded == frozenset() and d3.plan.generation == 3


def test_standby_restores_degree_after_fail_stop() -> None:
    st = tiny(tp=4, extra_devices=1)
    st = replace(st, plan=st.plan.with_(standbys=(4,)))
    d = planner().plan(st, stop(2))
    assert d.plan.group(0, 0) == (0, 1, 3, 4) and d.plan.standbys == ()


def test_memory_sets_k_min_and_an_infeasible_group_migrates_to_peers() -> None:
    # One layer needs 3 GiB of state at TP 1: TP 4 -> 0.75, TP 2 -> 1.5 GiB; devices 1 GiB.
    mem = MemoryModel(layer_state_gib=3.0)
    st = tiny(tp=4, dp=2, memory=mem, memory_gib=1.0)
    d = planner().plan(st, stop(1))
    assert d.plan.group(0, 0) == ()  # 3 survivors, k_min = 4: no feasible degree
    assert sorted(d.plan.standbys) == [0, 2, 3]
    moved = [m for m in d.plan.migrations if m.replica == 0]
    assert sorted(m.mb for m in moved) == list(range(4)) and {m.to for m in moved} == {1}


def test_deepspeed_like_adapter_drops_the_group_instead_of_shrinking() -> None:
    st = tiny(tp=2, pp=2, dp=2, capabilities=DEEPSPEED_LIKE)
    d = planner().plan(st, stop(st.plan.group(0, 1)[0]))
    assert d.plan.group(0, 1) == ()
    assert {m.to for m in d.plan.migrations} == {1}
    assert DEEPSPEED_LIKE.violations(d.plan, st.plan) == []
    # A slow device cannot be excluded by shrinking either: the degree stays 2.
    d2 = planner().plan(st, slow(st.plan.group(1, 0)[1], 0.4))
    assert {d2.plan.degree(r, s) for r, s in d2.plan.executors()} == {2}


# ----------------------------------------------------------------------- PP
def test_minmax_counts_hand_computed() -> None:
    assert minmax_counts([1, 2, 1], 12) == (5, 2, 5)  # docs/design.md's (4,4,4) -> (5,2,5)
    assert minmax_counts([1, 1, 1], 12) == (4, 4, 4)
    assert minmax_counts([1, 1, 1, 1], 10) in {(3, 3, 2, 2), (2, 3, 3, 2), (3, 2, 2, 3)}
    assert minmax_counts([1, 2, 1], 12, limits=[4, 4, 4]) == (4, 4, 4)
    assert minmax_counts([1, 1], 5, limits=[2, 2]) is None


def test_pp_middle_straggler_repartitions_444_to_525_and_it_is_the_simulated_optimum() -> None:
    # Three 4-layer stages, the middle device at half speed (its stage: 8 units vs 4).
    st = apply_report(tiny(pp=3, layers=12, m=8), slow(1, 0.5))
    out = pp_stage(st)
    assert counts(out.plan) == (5, 2, 5)
    # Judged by the simulator: (5,2,5) is the best of every contiguous partition.
    times = {
        c: st.evaluator.time(st.plan.with_(layer_ranges=ranges_from_counts(c)))
        for c in itertools.product(range(1, 11), repeat=3) if sum(c) == 12
    }
    assert min(times, key=times.get) == (5, 2, 5)
    # Healthy: nothing to move.
    assert counts(pp_stage(tiny(pp=3, layers=12, m=8)).plan) == (4, 4, 4)


def test_pp_respects_memory_limits() -> None:
    # 1 GiB per layer at TP 1, devices of 4 GiB: no stage may hold 5 layers.
    st = apply_report(tiny(pp=3, layers=12, m=8, memory=MemoryModel(layer_state_gib=1.0),
                           memory_gib=4.0), slow(1, 0.5))
    assert counts(pp_stage(st).plan) == (4, 4, 4)


# ----------------------------------------------------------------------- DP
def test_progress_aware_replay_hand_computed() -> None:
    # One stage, two replicas; replica 0 at half speed: its micro-batch takes 2 units
    # (6 ms), replica 1's 1 unit. Before micro-batch j, replica 0's lag behind the
    # fastest is (clock_0 - clock_1) / 2 micro-batches: j=0: 0, j=1: 0.5, j=2: 1,
    # j=3: 1.5 > delta=1 -> micro-batch 3 moves to replica 1 (finishes at 5 < 8).
    st = tiny(dp=2, m=6, speeds={0: 0.5})
    assert balance(st, st.plan, delta=1, aggressiveness=0).migrations == (Migration(0, 0, 3, 1),)
    # delta = 0: j=1 (lag 0.5) and j=4 (lag 0.5) move.
    assert [m.mb for m in balance(st, st.plan, delta=0, aggressiveness=0).migrations] == [1, 4]
    # Aggressiveness prices the slow group higher, so it hands over more.
    assert len(balance(st, st.plan, delta=1, aggressiveness=1).migrations) > 1


def test_dp_respects_destination_memory() -> None:
    # GPipe keeps every micro-batch's activations: 1 GiB each, 6 per device fit exactly.
    mem = MemoryModel(layer_activation_gib=1.0)
    full = tiny(dp=2, m=6, schedule=ScheduleKind.GPIPE, memory=mem, memory_gib=6.0, speeds={0: 0.5})
    assert balance(full, full.plan, delta=1, aggressiveness=0).migrations == ()
    room = tiny(dp=2, m=6, schedule=ScheduleKind.GPIPE, memory=mem, memory_gib=7.0, speeds={0: 0.5})
    assert len(balance(room, room.plan, delta=0, aggressiveness=0).migrations) == 1


def test_dp_stage_never_returns_a_slower_plan() -> None:
    st = tiny(pp=2, dp=3, m=6, speeds={1: 0.4})
    t_in = st.evaluator.time(st.plan)
    out = dp_stage(st)
    assert st.evaluator.time(out.plan) <= t_in
    r, s, _ = st.plan.location(1)
    assert out.plan.migrations and all((m.replica, m.stage) == (r, s) for m in out.plan.migrations)


def test_fail_stopped_group_work_is_drained_exactly_once() -> None:
    st = tiny(pp=2, dp=3, m=5)
    d = planner().plan(st, stop(st.plan.group(0, 1)[0]))
    assert d.plan.group(0, 1) == ()
    drained = sorted(m.mb for m in d.plan.migrations if (m.stage, m.replica) == (1, 0))
    assert drained == list(range(5))
    check_programs(d.programs())


# ------------------------------------------------------------ planner, escalation
def test_decision_bumps_generation_and_emits_runnable_programs() -> None:
    st = tiny(tp=2, pp=2, dp=2, m=4)
    d = planner().plan(st, slow(st.plan.group(0, 1)[0], 0.3))
    assert d.kind == "continue" and d.plan.generation == st.plan.generation + 1
    assert set(d.timings) >= {"tp", "pp", "dp", "drop", "total"}
    assert d.predicted_time == pytest.approx(d.state.evaluator.time(d.plan))
    assert d.predicted_time < apply_report(st, slow(st.plan.group(0, 1)[0], 0.3)).evaluator.time(st.plan)
    assert "fail-slow" in d.reason and "tp:" in d.reason
    progs = d.programs()
    check_programs(progs)
    assert all(p.generation == d.plan.generation for p in progs)


def test_every_replica_of_a_stage_lost_restores_on_survivors() -> None:
    st = tiny(tp=2, pp=2, dp=1, m=4, devices_per_node=4)
    d = planner().plan(st, stop(*st.plan.group(0, 1)))
    assert d.kind == "restore"
    assert d.plan.pp == 2 and d.plan.dp * d.plan.num_microbatches == 4
    assert not set(d.plan.devices()) & {2, 3}
    assert {d.plan.degree(r, s) for r, s in d.plan.executors()} == {1}


def test_restore_keeps_the_global_batch_without_cross_replica_migration() -> None:
    caps = Capabilities(tp_resize=False, heterogeneous_tp=False, layer_repartition=True,
                        cross_replica_migration=False, checkpoint=True)
    st = tiny(tp=2, pp=2, dp=2, m=3, capabilities=caps)
    d = planner().plan(st, stop(st.plan.group(1, 1)[0]))
    assert d.kind == "restore" and d.plan.dp == 1 and d.plan.num_microbatches == 6
    assert not d.plan.migrations


def test_restore_shrinks_to_fewer_stages_as_far_as_memory_allows() -> None:
    """One device left for two stages: with layer repartition the restore runs the whole
    model as one stage on it; without, or when one device cannot hold the whole model in
    memory, it is an error that says so."""
    st = tiny(tp=1, pp=2, dp=1, m=2, devices_per_node=2)
    d = planner().plan(st, stop(1))
    assert d.kind == "restore" and d.plan.pp == 1 and tuple(d.plan.devices()) == (0,)
    assert d.plan.layer_ranges == ((0, 2),) and d.plan.dp * d.plan.num_microbatches == 2
    check_programs(d.programs())
    fixed = replace(Capabilities.all(), layer_repartition=False)
    with pytest.raises(PlannerError, match="cannot restore: 1 surviving devices cannot hold 2 stages"):
        planner().plan(tiny(tp=1, pp=2, dp=1, m=2, devices_per_node=2, capabilities=fixed), stop(1))
    # 50 GiB per layer: one layer fits an 80 GiB device, the whole model does not.
    big = tiny(tp=1, pp=2, dp=1, m=2, devices_per_node=2, memory=MemoryModel(layer_state_gib=50.0))
    with pytest.raises(PlannerError, match="cannot hold 2 or fewer stages"):
        planner().plan(big, stop(1))


def test_restore_impossible_and_no_checkpoint_are_errors() -> None:
    caps = replace(Capabilities.all(), checkpoint=False)
    st2 = tiny(tp=1, pp=2, dp=1, m=2, capabilities=caps)
    with pytest.raises(PlannerError, match="checkpoint"):
        planner().plan(st2, stop(1))


def test_scale_back_up_after_restore_when_devices_return() -> None:
    st = tiny(tp=2, pp=2, dp=1, m=4, devices_per_node=4)
    d = planner().plan(st, stop(2, 3))
    assert d.kind == "restore" and d.plan.degree(0, 0) == 1
    back = planner().rejoin(d.state, [2, 3])
    assert back.kind == "restore"
    assert {back.plan.degree(r, s) for r, s in back.plan.executors()} == {2}
    assert back.plan.generation == d.plan.generation + 1


def test_drop_stage_empties_a_slow_group_when_many_peers_can_absorb_it() -> None:
    # Eight replicas: a group at 0.3 costs 3.3x; dropping it adds 1/7 to seven peers.
    st = apply_report(tiny(pp=2, dp=8, m=7, effort="thorough"), slow(3, 0.3))
    out = drop_stage(replace(st, previous=st.plan))
    r, s, _ = st.plan.location(3)
    assert out.plan.group(r, s) == ()
    assert st.evaluator.time(out.plan) < st.evaluator.time(st.plan)


def test_communication_fail_slow_excludes_the_device_by_effective_throughput() -> None:
    st = job_state(tp=4, pp=2, dp=2, num_microbatches=4, model="llama2-7b")
    dev = st.plan.group(0, 1)[1]
    after = apply_report(st, slow(dev, 0.05, "communication"))
    assert after.link_speeds == {dev: 0.05} and after.speeds == {}
    assert after.throughput(dev) < 0.5
    d = planner().plan(st, slow(dev, 0.05, "communication"))
    assert dev not in d.plan.devices()


def test_stage_plugins_replace_builtins_and_bad_stages_are_named() -> None:
    calls: list[str] = []

    class MyPP:
        @hookimpl
        def resihp_register_adaptation_stages(self, registry) -> None:
            def my_pp(state: PlannerState) -> PlannerState:
                calls.append("mine")
                return state
            registry.register("pp", my_pp)

    plugins = Plugins(builtins=[scheduler_builtin], autoload=False)
    plugins.register(MyPP(), "my-pp")
    p = Planner(plugins=plugins)
    assert [s.name for s in p.stages] == ["tp", "pp", "dp", "drop"]
    st = tiny(pp=3, layers=12, m=4)
    d = p.plan(st, slow(1, 0.5))
    assert calls == ["mine"] and counts(d.plan) == (4, 4, 4)

    def evil(state: PlannerState) -> PlannerState:
        return state.with_plan(state.previous)  # puts the failed device back

    with pytest.raises(PlannerError, match="'evil'.*failed"):
        Planner(stages=[DEFAULT_STAGES[0], AdaptationStage("evil", evil, 150)]).plan(tiny(tp=2), stop(1))


def test_fail_slow_report_needs_throughputs_and_known_devices() -> None:
    st = tiny(tp=2)
    with pytest.raises(PlannerError, match="throughput"):
        planner().plan(st, FailureReport(generation=0, failure="fail-slow", devices=(1,)))
    with pytest.raises(PlannerError, match="unknown device"):
        planner().plan(st, stop(99))


# ------------------------------------------------------------ evaluator
def test_item_cost_matches_the_predictor_and_slow_links_slow_every_transfer() -> None:
    st = job_state(tp=4, pp=2, dp=2, num_microbatches=4, model="llama2-7b")
    plan = st.plan.with_(
        tp_groups=((st.plan.group(0, 0), st.plan.group(0, 1)[:2]), st.plan.tp_groups[1]),
        migrations=(Migration(1, 0, 1, 1), Migration(0, 1, 3, 0)),
        standbys=st.plan.group(0, 1)[2:],
    )
    st = st.with_health(speeds={plan.group(1, 1)[0]: 0.5})
    inp = st.evaluator.inputs(plan)
    item = st.evaluator.item_cost(plan).item(plan)
    for (s, r, j), e in plan.executor_map().items():
        assert inp["durations"][:, s, r, j].sum() == pytest.approx(item[s, e, r, j], rel=1e-9)
    dev = plan.group(0, 1)[0]
    slowed = st.with_health(link_speeds={dev: 0.5}).evaluator.inputs(plan)
    assert slowed["durations"][0, 1, 0, 0] > inp["durations"][0, 1, 0, 0]  # TP all-reduce
    assert slowed["comm_forward"][1, 0, 0] == pytest.approx(2 * inp["comm_forward"][1, 0, 0])
    assert slowed["reduce_time"][1] == pytest.approx(2 * inp["reduce_time"][1])
    assert slowed["reduce_time"][0] == pytest.approx(inp["reduce_time"][0])


def test_memory_is_checked_after_every_stage() -> None:
    def overflow(state: PlannerState) -> PlannerState:
        return replace(state, memory=MemoryModel(layer_state_gib=1e6))

    with pytest.raises(PlannerError, match="'overflow' overflows device memory"):
        Planner(stages=[AdaptationStage("overflow", overflow, 100)]).plan(tiny(), slow(0, 0.5))


def test_planner_reads_default_stages_from_plugins() -> None:
    p = Planner(plugins=Plugins(builtins=[scheduler_builtin], autoload=False))
    assert [(s.name, s.order) for s in p.stages] == [("tp", 100), ("pp", 200), ("dp", 300), ("drop", 400)]
    assert np.isfinite(p.plan(tiny(dp=2, m=2), slow(0, 0.5)).predicted_time)


UNEVEN_DP = Capabilities(layer_repartition=True, uneven_dp=True, checkpoint=True,
                         schedules=frozenset({ScheduleKind.ONE_F_ONE_B}))


def test_uneven_dp_adapters_get_every_survivor_at_pp1_and_whole_micro_batches_only() -> None:
    """An adapter that runs other replicas' micro-batches only whole (``uneven_dp``):
    at pp = 1 a kill leaves the survivors uneven counts (no restore, no standby) and a
    slow replica sheds micro-batches; at pp > 1 the Scheduler (whose stages migrate
    single stages) restores instead, and a single-stage migration is a violation."""
    st = tiny(pp=1, dp=4, m=2, capabilities=UNEVEN_DP)
    d = planner().plan(st, stop(3))
    assert d.kind == "continue" and sorted(d.plan.devices()) == [0, 1, 2] and not d.plan.standbys
    assert sorted(len(d.plan.work(r, 0)) for r in range(3)) == [2, 3, 3]
    assert not UNEVEN_DP.violations(d.plan)
    s = planner().plan(tiny(pp=1, dp=4, m=4, capabilities=UNEVEN_DP), slow(2, 1 / 3))
    assert len(s.plan.work(2, 0)) < 4 and sum(len(s.plan.work(r, 0)) for r in range(4)) == 16
    p2 = tiny(pp=2, dp=2, m=2, capabilities=UNEVEN_DP)
    d2 = planner().plan(p2, stop(p2.plan.group(1, 1)[0]))
    assert d2.kind == "restore" and not d2.plan.migrations
    single = p2.plan.with_(migrations=(Migration(1, 1, 0, 0),))
    assert any("single stage" in w for w in UNEVEN_DP.violations(single))
    whole = p2.plan.with_(migrations=(Migration(0, 1, 0, 0), Migration(1, 1, 0, 0)))
    assert not UNEVEN_DP.violations(whole) and Capabilities(cross_replica_migration=True).uneven_dp


def test_restore_puts_each_stage_on_the_survivors_that_hold_it() -> None:
    """PP2 x DP2 with a node per stage (replica 0: 0 | 2, replica 1: 1 | 3), an adapter
    that cannot migrate across replicas; device 3 dies. The one-replica layout takes
    stage 1 from device 2, its only survivor, and leaves device 1 (a second copy of
    stage 0) as the standby: with device 2 left out, stage 1's trained state had no
    holder and the job restarted from a checkpoint (the first GPU check's kill row)."""
    from resihp_core.plan import parse_plan

    caps = Capabilities(tp_resize=False, heterogeneous_tp=False, layer_repartition=True,
                        cross_replica_migration=False, checkpoint=True)
    st = tiny(pp=2, dp=2, m=4, layers=4, devices_per_node=2, capabilities=caps)
    plan = parse_plan("resihp-plan v1\ngeneration 0\nschedule 1f1b\nlayers 4\nmicrobatches 4\n"
                      "stages 0-2 2-4\nreplica 0: 0 | 2\nreplica 1: 1 | 3\n")
    st = replace(st, plan=plan, home=plan)
    d = planner().plan(st, stop(3))
    assert d.kind == "restore" and d.plan.dp == 1 and d.plan.num_microbatches == 8
    assert d.plan.tp_groups == (((0,), (2,)),) and d.plan.standbys == (1,), d.plan.to_text()


def test_an_adapter_that_restages_keeps_every_survivor_busy_in_whole_replicas() -> None:
    """PP2 x DP2 (6 layers, 4 micro-batches), an adapter that cannot keep a partial
    replica busy: a kill leaves 3 survivors. Without ``restage`` the one-replica PP2
    layout leaves one on standby; with it the simulator prefers PP3 x DP1 (2 layers a
    stage, the same 8 micro-batches in one replica), every survivor placed."""
    from resihp_core.plan import even_layer_ranges

    caps = replace(UNEVEN_DP, restage=True)
    for c, want_pp in ((UNEVEN_DP, 2), (caps, 3)):
        st = tiny(pp=2, dp=2, m=4, layers=6, devices_per_node=4, capabilities=c)
        dead = st.plan.group(1, 1)[0]
        d = planner().plan(st, stop(dead))
        assert d.kind == "restore" and d.plan.dp == 1 and d.plan.num_microbatches == 8, d.reason
        assert d.plan.pp == want_pp, d.plan.to_text()
        placed = sorted(d.plan.devices())
        assert (len(placed), len(d.plan.standbys)) == ((2, 1) if want_pp == 2 else (3, 0)), d.plan.to_text()
        assert dead not in placed and not d.plan.migrations
        if c is caps:
            assert "restage-pp3" in d.reason and d.plan.layer_ranges == tuple(even_layer_ranges(6, 3))
            assert d.state.home.tp_groups == d.plan.tp_groups  # the new layout is the Scheduler's home
            assert not caps.violations(d.plan, st.plan)
            # the next kill plans on the re-staged layout (two survivors: PP2, or PP1 x DP2)
            d2 = planner().plan(d.state, stop(d.plan.group(0, 2)[0]))
            assert len(set(d2.plan.devices())) == 2 and d2.plan.dp * d2.plan.num_microbatches == 8
    # A re-stage onto every device is judged too when the stages leave one idle, and
    # loses to dropping a device at 5% speed (PP1 x DP4: it would gate every stage).
    st = tiny(pp=1, dp=4, m=4, layers=6, devices_per_node=4, capabilities=caps)
    d = planner().plan(st, slow(3, 0.05))
    assert d.plan.pp == 1 and d.plan.standbys == (3,) and "restage" not in d.reason, d.reason
