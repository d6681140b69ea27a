"""The DeepSpeed adapter's pieces that need no processes: lowering programs to DeepSpeed
instructions, the plan -> grid mapping, the layer-transfer plan, micro-batch addressing,
ZeRO 1 fragments, and the clear errors (partial replicas, bad configs)."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from resihp_core.plan import Migration, ParallelPlan, ScheduleKind  # noqa: E402
from resihp_core.predictor.schedules import emit_programs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
pytestmark = pytest.mark.deepspeed


def _progs(plan):
    return {(p.replica, p.stage): p for p in emit_programs(plan)}


def test_lowering_maps_peers_to_ranks_and_commits_before_the_step():
    from deepspeed.runtime.pipe import schedule as S

    from resihp_adapters.deepspeed.engine import (CommitPoint, LoadAddressed, RecvActivationFrom, SendActivationTo,
                                                  SendGradTo, lower_program, rank_of)

    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)
    plan = base.with_(migrations=(Migration(1, 0, 1, 1),))  # stage 1 of (r0, mb1) runs on replica 1
    low = lower_program(_progs(plan)[(0, 0)], plan)
    sends = [c for c in low.instructions() if isinstance(c, SendActivationTo)]
    assert sorted(c.peer for c in sends) == sorted([rank_of(plan, 0, 1), rank_of(plan, 1, 1)])
    assert rank_of(plan, 1, 1) == 3 and rank_of(plan, 0, 1) == 2
    kinds = [type(c) for c in low.instructions()]
    assert kinds[-4:] == [S.ReduceTiedGrads, S.ReduceGrads, CommitPoint, S.OptimizerStep]
    loads = [(c.owner, c.mb) for c in low.instructions() if isinstance(c, LoadAddressed)]
    assert loads == [(0, 0), (0, 1)]
    # The migrated piece's executor receives from replica 0's stage 0 and sends its gradient back.
    low1 = lower_program(_progs(plan)[(1, 1)], plan)
    recv = [c.peer for c in low1.instructions() if isinstance(c, RecvActivationFrom)]
    back = [c.peer for c in low1.instructions() if isinstance(c, SendGradTo)]
    assert recv.count(rank_of(plan, 0, 0)) == 1 and back.count(rank_of(plan, 0, 0)) == 1
    assert len(low1.buffers) == 3  # its own two micro-batches and the migrated one


def test_lowering_refuses_split_backward():
    from resihp_adapters.deepspeed.engine import lower_program

    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=2, schedule=ScheduleKind.ZB_H1)
    with pytest.raises(ValueError, match="ZB-H1"):
        lower_program(_progs(plan)[(0, 1)], plan)


def test_grid_leaves_out_dropped_replicas_and_numbers_partial_ones_without_holes():
    from resihp_adapters.deepspeed.engine import (PartialTopology, device_rank, is_partial, live_replicas,
                                                  lower_program, plan_topology)

    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)  # r0: 0,2  r1: 1,3
    moves = tuple(Migration(s, 0, j, 1) for s in range(2) for j in range(2))
    dropped = base.with_(tp_groups=(((), ()), base.tp_groups[1]), migrations=moves)
    assert live_replicas(dropped) == [1]
    assert plan_topology(dropped).world_size() == 2
    assert [device_rank(dropped, d) for d in dropped.devices()] == [0, 1]
    # Device 3 (replica 1, stage 1) lost: replica 1 keeps stage 0, its stage-1 work runs
    # on replica 0. DeepSpeed's order (stage-major) without the hole: 0, 1 | 2.
    partial = base.with_(tp_groups=(base.tp_groups[0], ((1,), ())),
                         migrations=tuple(Migration(1, 1, j, 0) for j in range(2)))
    assert is_partial(partial) and live_replicas(partial) == [0, 1]
    topo = plan_topology(partial)
    assert isinstance(topo, PartialTopology) and topo.world_size() == 3
    assert {d: device_rank(partial, d) for d in (0, 1, 2)} == {0: 0, 1: 1, 2: 2}
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2]]  # stage 0 reduces over 2, stage 1 alone
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1]]
    assert topo.get_rank(pipe=1, data=1) is None
    # Replica 1's stage 0 sends its activations to replica 0's stage 1 (rank 2).
    sends = [c for c in lower_program(_progs(partial)[(1, 0)], partial).instructions()
             if type(c).__name__ == "SendActivationTo"]
    assert sends and {c.kwargs["peer"] for c in sends} == {2}


def test_transfer_plan_moves_layers_and_asks_for_a_restore_when_nobody_holds_one():
    from resihp_adapters.deepspeed.state import LayersLost, transfer_plan

    old = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=6, num_microbatches=2)  # r0: 0,2  r1: 1,3
    new = old.with_(layer_ranges=((0, 2), (2, 6)))
    moves = transfer_plan(old, new, {0, 1, 2, 3})
    assert {(t.layer, t.dst) for t in moves} == {(2, 2), (2, 3)}
    assert all(t.src in (0, 1) for t in moves)  # from a stage-0 holder
    # Both stage-0 devices dead: new devices 4 and 5 cannot get layers 0-2 from anyone.
    lost = old.with_(tp_groups=(((4,), (2,)), ((5,), (3,))), excluded=frozenset({0, 1}))
    with pytest.raises(LayersLost, match="device 4: layers \\[0, 1, 2\\]; device 5: layers \\[0, 1, 2\\]"):
        transfer_plan(old, lost, {2, 3})
    # Device 1 dead, a new standby 4 takes its place: it gets stage 0 from device 0.
    back = old.with_(tp_groups=(old.tp_groups[0], ((4,), (3,))), excluded=frozenset({1}))
    ok = transfer_plan(old, back, {0, 2, 3})
    # ... and the global unit (optimizer hyperparameters, LR scheduler, counters) from a survivor.
    assert {(t.layer, t.dst) for t in ok} == {(0, 4), (1, 4), (2, 4), ("global", 4)}
    assert {t.src for t in ok if t.layer != "global"} == {0}


def test_a_tied_group_moves_once_to_every_stage_that_needs_it():
    from resihp_adapters.deepspeed.state import transfer_plan, units_of

    # Layers 0 and 5 share one weight (TiedLayerSpec "embed"): both stages hold a copy.
    tied = {"embed": {0, 5}}
    old = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=6, num_microbatches=2)  # r0: 0,2  r1: 1,3
    assert units_of(old, 0, tied) == ([0, 1, 2, "tied.embed", "global"], 0)
    assert units_of(old, 2, tied) == ([3, 4, 5, "tied.embed", "global"], 0)
    # Device 3 dead, replica 0 alone, layers (5, 1): stage 1 keeps its copy, layers 3, 4 move.
    new = old.with_(tp_groups=(old.tp_groups[0],), layer_ranges=((0, 5), (5, 6)), standbys=(1,),
                    excluded=frozenset({3}))
    moves = transfer_plan(old, new, {0, 1, 2}, tied)
    assert {(t.layer, t.src, t.dst) for t in moves} == {(3, 2, 0), (4, 2, 0)}
    # A plan cutting the tied layers into one stage: the copy is still held, once, there.
    one = old.with_(layer_ranges=((0, 1), (1, 6)))
    assert "tied.embed" in units_of(one, 0, tied)[0] and "tied.embed" in units_of(one, 2, tied)[0]
    # Nobody holds the tied group (both stages' devices gone): a restore is required.
    from resihp_adapters.deepspeed.state import LayersLost

    gone = old.with_(tp_groups=(((4,), (5,)),), standbys=(), excluded=frozenset({0, 1, 2, 3}))
    with pytest.raises(LayersLost, match="tied.embed"):
        transfer_plan(old, gone, set(), tied)


def test_json_adam_becomes_deepspeeds_own_torch_fallback_and_unsupported_configs_are_refused():
    from resihp_adapters.deepspeed.spec import check_supported, torch_optimizer_config

    said = []
    cfg = torch_optimizer_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, log=said.append)
    assert cfg["optimizer"]["params"] == {"lr": 1e-3, "torch_adam": True} and "FusedAdam" in said[0]
    same = {"optimizer": {"type": "Adam", "params": {"torch_adam": False}}}
    assert torch_optimizer_config(same) == same  # the user's explicit choice stays
    assert torch_optimizer_config({"optimizer": {"type": "SGD"}}) == {"optimizer": {"type": "SGD"}}
    for bad, why in (({"zero_optimization": {"stage": 2}}, "stages 0 and 1 only"),
                     ({"fp16": {"enabled": True}}, "loss scaler")):
        with pytest.raises(ValueError, match=why):
            check_supported(bad)
    check_supported({"zero_optimization": {"stage": 1}})  # carried: docs/deepspeed.md, ZeRO


def test_micro_batches_are_addressed_like_deepspeeds_sampler():
    from torch.utils.data import DistributedSampler

    from resihp_adapters.deepspeed.data import MicroBatchSource

    data = list(range(40))
    src = MicroBatchSource(data, list, micro_batch_size=2, num_microbatches=3, replicas=2)
    for r in range(2):
        order = list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=False))
        got = [i for it in range(3) for j in range(3) for i in src.indices(it, r, j)]
        assert got == order[: len(got)]
    with pytest.raises(ValueError, match="replica 2"):
        src.indices(0, 2, 0)
    # deepspeed_io's order: a shuffling DistributedSampler (seed 0, epoch 0 on every pass),
    # with a dataset that does not split evenly (the sampler pads), over two passes.
    data = list(range(41))
    src = MicroBatchSource(data, list, micro_batch_size=3, num_microbatches=2, replicas=2, shuffle=True, seed=0)
    for r in range(2):
        order = list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0)) * 3
        got = [i for it in range(6) for j in range(2) for i in src.indices(it, r, j)]
        assert got == order[: len(got)]


def test_zero_1_shards_come_from_every_holder_and_a_gap_is_detected():
    """ZeRO 1: a unit's optimizer state is split over its stage's replicas. Every
    surviving holder sends its fragment; the rank that needs elements no survivor
    holds finds out (and the adapter then raises StateLost on every rank)."""
    from types import SimpleNamespace as NS

    from resihp_adapters.deepspeed.state import (ShardsMissing, _apply_zero_fragments, merge_units,
                                                 transfer_plan)

    old = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=6, num_microbatches=2)  # r0: 0,2  r1: 1,3
    new = old.with_(layer_ranges=((0, 2), (2, 6)))
    moves = transfer_plan(old, new, {0, 1, 2, 3}, sharded=True)
    # Layer 2 goes to both stage-1 ranks from both stage-0 holders; stage 1's own layers
    # (3-5) are exchanged between its two ranks; the global unit moves nowhere.
    assert {(t.layer, t.src, t.dst) for t in moves if t.layer == 2} == {(2, s, d) for s in (0, 1) for d in (2, 3)}
    assert {(t.layer, t.src, t.dst) for t in moves if t.layer == 4} == {(4, 2, 3), (4, 3, 2)}
    assert not [t for t in moves if t.layer == "global"]

    # A 10-element parameter; this rank's partition holds its elements 4..9 at flat offset 1.
    flat = torch.zeros(8, dtype=torch.float64)
    zero = NS(single_partition_of_fp32_groups=[flat], optimizer=NS(state={}), _hp_optimizer_states_linked=False)
    p = NS(_hp_mapping=NS(lp_fragment_address=NS(start=4, numel=6), hp_fragment_address=NS(start=1, numel=6),
                          param_group_index=0))
    full = torch.arange(10, dtype=torch.float64)

    def frag(a: int, b: int) -> dict:
        return {"start": a, "numel": b - a, "master": full[a:b].clone(),
                "opt": {"exp_avg": -full[a:b].clone(), "step": torch.tensor(3.0)}}

    # Two holders of another layout (elements 0..5 and 5..9) cover it.
    unit = merge_units({"params": {}, "zero": {"w": [frag(0, 5)]}}, {"params": {}, "zero": {"w": [frag(5, 10)]}})
    _apply_zero_fragments(zero, p, unit["zero"]["w"], "w")
    assert flat[1:7].tolist() == full[4:].tolist() and flat[0] == 0 and flat[7] == 0
    assert zero.optimizer.state[flat]["exp_avg"][1:7].tolist() == (-full[4:]).tolist()
    assert float(zero.optimizer.state[flat]["step"]) == 3.0
    # The holder of elements 5..9 died: elements 5..9 of this rank's partition are gone.
    with pytest.raises(ShardsMissing, match="5 of the 6 elements"):
        _apply_zero_fragments(zero, p, [frag(0, 5)], "w")


def test_spec_and_launch_config_errors_name_the_field(tmp_path):
    import _model as M

    from resihp_adapters.deepspeed.launch import accelerate_env, read_resihp_section
    from resihp_adapters.deepspeed.spec import PipelineSpec

    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        PipelineSpec(layers=M.layer_specs(2), config={}, dataset=M.Samples())
    with pytest.raises(ValueError, match="resihp.iterations"):
        read_resihp_section({"resihp": {"num_layers": 4}}, "ds.json")
    with pytest.raises(ValueError, match=r"resihp.checkpont_every: unknown key \(did you mean 'checkpoint_every'\?\)"):
        read_resihp_section({"resihp": {"num_layers": 4, "iterations": 2, "checkpont_every": 1}}, "ds.json")
    example = os.path.join(HERE, "..", "..", "..", "examples", "deepspeed_pipeline")
    a, env = accelerate_env(os.path.join(example, "accelerate.yaml"), "train.py", [])
    assert a.num_processes == 4 and env["ACCELERATE_USE_DEEPSPEED"] == "true"
    ds = env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    assert os.path.isabs(ds) and json.load(open(ds))["resihp"]["num_layers"] == 6


def test_a_partial_replica_runs_as_its_whole_replica_equivalent():
    from resihp_adapters.deepspeed.engine import live_replicas, whole_replicas

    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)  # r0: 0,2  r1: 1,3
    # What the Scheduler makes of a dead device 3: replica 1 keeps stage 0 on device 1.
    partial = base.with_(tp_groups=(base.tp_groups[0], ((1,), ())), excluded=frozenset({3}),
                         migrations=tuple(Migration(1, 1, j, 0) for j in range(2)))
    x = whole_replicas(partial)
    assert live_replicas(x) == [0] and 1 in x.standbys
    # Device 1 idles in that equivalent, and its log says exactly why.
    from resihp_adapters.deepspeed.adapter import DeepSpeedAdapter

    from types import SimpleNamespace as NS

    a = DeepSpeedAdapter.__new__(DeepSpeedAdapter)
    a.ctx, a.zero_stage, a.config = NS(device=1), 1, {"bf16": {"enabled": True}}
    why = a.idle_reason(partial)
    assert why.startswith("replica 1 lost a stage; its remaining work runs on a whole replica") and \
        "ZeRO stage 1 and bf16 reduces and partitions" in why, why
    a.zero_stage, a.config = 0, {}
    assert a.runnable(partial) is partial  # ZeRO 0, fp32: kept as it is, nobody idles
    assert x.executor_map() == {k: 0 for k in partial.executor_map()}  # every piece once, on replica 0
    assert whole_replicas(base) is base


def test_zero1_and_bf16_launches_restage_the_survivors_into_whole_replicas(tmp_path):
    """``resihp launch`` tells the Scheduler what the configuration runs: ZeRO 0 fp32
    keeps the partial replica (device 1 busy on its stage, migrations); ZeRO 1 or bf16
    runs whole replicas only, and a kill on PP2 x DP2 re-stages the 3 survivors as
    PP3 x DP1 (the same 8 micro-batches) instead of leaving one on standby."""
    from resihp_core.protocol import FailureReport

    from resihp_adapters.deepspeed.launch import assemble_launch
    from resihp_adapters.deepspeed.plugin import CAPABILITIES, capabilities_for

    kill = FailureReport(generation=0, failure="fail-stop", devices=(3,))
    sec = {"pp": 2, "num_layers": 6, "iterations": 4}
    for extra in ({}, {"bf16": {"enabled": True}}, {"zero_optimization": {"stage": 1}}):
        ds = {"gradient_accumulation_steps": 4, **extra}
        job = assemble_launch(4, ds, sec, tmp_path)
        caps = job.run.planner.capabilities
        assert caps == job.run.state.capabilities == capabilities_for(ds)
        d = job.run.planner.plan(job.run.state, kill)
        assert sorted(d.plan.devices()) == [0, 1, 2] and not d.plan.standbys, d.plan.to_text()
        if not extra:
            assert caps == CAPABILITIES and d.plan.pp == 2 and d.plan.migrations
        else:
            assert not caps.cross_replica_migration and caps.restage
            assert (d.plan.pp, d.plan.dp, d.plan.num_microbatches) == (3, 1, 8) and "restage-pp3" in d.reason


def test_resihp_launch_stops_on_configuration_errors_with_the_reason(tmp_path, capsys):
    """ZeRO 2/3 (fp16), ZeRO 1 without checkpoints, a partition_method DeepSpeed does not
    implement and a script that never calls initialize() stop the launch
    before any worker starts: the reason on the console, a non-zero exit, no device failure."""
    import argparse
    import shutil

    from resihp_adapters.deepspeed.launch import run
    from resihp_core.cli import CliError

    example = os.path.join(HERE, "..", "..", "..", "examples", "deepspeed_pipeline")
    for f in ("accelerate.yaml", "train.py", "ds_config.json"):
        shutil.copy(os.path.join(example, f), tmp_path / f)
    ns = argparse.Namespace(config_file=str(tmp_path / "accelerate.yaml"), workdir=str(tmp_path / "w"), timeout=60.0,
                            training_script=str(tmp_path / "train.py"), training_script_args=[])
    cfg = json.loads((tmp_path / "ds_config.json").read_text())
    for stage, why in ((2, "ZeRO stages 0 and 1 only"), (3, "ZeRO stages 0 and 1 only")):
        (tmp_path / "ds_config.json").write_text(json.dumps({**cfg, "zero_optimization": {"stage": stage}}))
        with pytest.raises(CliError, match=why) as e:
            run(ns)
        assert e.value.code != 0
    zero1 = {**cfg, "zero_optimization": {"stage": 1}, "resihp": {**cfg["resihp"], "checkpoint_every": 0}}
    (tmp_path / "ds_config.json").write_text(json.dumps(zero1))
    with pytest.raises(CliError, match="stage=1 with resihp.checkpoint_every=0.*only copy of its optimizer-state"):
        run(ns)
    (tmp_path / "ds_config.json").write_text(json.dumps(cfg))
    script = (tmp_path / "train.py").read_text()
    assert "initialize(layers," in script
    assert 'partition_method="parameters"' in script
    (tmp_path / "train.py").write_text(script.replace('partition_method="parameters"', 'partition_method="profile"'))
    with pytest.raises(CliError, match="partition_method='profile'.*'uniform', 'parameters' and 'type:<regex>'"):
        run(ns)
    (tmp_path / "train.py").write_text("import deepspeed\nprint('training without initialize')\n")
    with pytest.raises(CliError, match="never calls initialize"):
        run(ns)
    (tmp_path / "train.py").write_text("import deepspeed\nengine, *_ = deepspeed.initialize(model=None)\n")
    with pytest.raises(CliError, match="never calls initialize"):
        run(ns)
    assert not (tmp_path / "w").exists()  # nothing was started


def test_initial_split_is_deepspeeds_own_and_the_launch_probe_reports_it(tmp_path):
    """``partition_method`` under ``resihp launch``: the split is the one DeepSpeed's
    ``PipelineModule`` makes (checked against DeepSpeed's ``partition_balanced`` of the
    layers' parameter counts and its ``partition_uniform``); a split leaving a stage
    empty is refused. (The launcher's probe run of the script, and that a real
    ``PipelineModule`` makes the same split, are the launch test's.)"""
    import torch
    from deepspeed.pipe import LayerSpec
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    from resihp_adapters.deepspeed.launch import check_script_calls_initialize
    from resihp_adapters.deepspeed.partition import check_partition_method, deepspeed_parts, parts_to_ranges

    class Wide(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 64)

    layers = [LayerSpec(Wide), *(LayerSpec(torch.nn.Linear, 8, 8) for _ in range(5))]
    counts = [8 * 64 + 64, *([8 * 8 + 8] * 5)]
    before = torch.get_rng_state()
    got = deepspeed_parts(layers, 2, "parameters")
    assert torch.equal(before, torch.get_rng_state())  # building layers to count them leaves no trace
    assert got == partition_balanced(weights=counts, num_parts=2) == [0, 1, 6]
    assert deepspeed_parts(layers, 3, "uniform") == partition_uniform(num_items=6, num_parts=3) == [0, 2, 4, 6]
    # "type:": DeepSpeed's case-insensitive regex on the layer class names (Wide is no match).
    assert deepspeed_parts(layers, 2, "type:LINEAR") == partition_balanced(weights=[0, 1, 1, 1, 1, 1], num_parts=2)
    assert check_partition_method("Parameters") == "parameters"
    with pytest.raises(ValueError, match="'uniform', 'parameters' and 'type:<regex>' only"):
        check_partition_method("profile")
    with pytest.raises(ValueError, match=r"stage\(s\) \[1\] without layers"):
        parts_to_ranges([0, 6, 6])

    # The launcher reads the method from the unchanged example (its probe run, which asks
    # initialize() for this split, is the launch test's: test_deepspeed_launch.py).
    example = os.path.join(HERE, "..", "..", "..", "examples", "deepspeed_pipeline")
    assert check_script_calls_initialize(os.path.join(example, "train.py")) == "parameters"


def test_the_deepspeed_demo_writes_the_default_demos_report(tmp_path):
    """``resihp demo --adapter deepspeed --report DIR``: the same files as the default
    demo (events JSON, loss / iteration time / throughput plots, summary), phases split
    at the kill, start-up kept out of the trace."""
    from types import SimpleNamespace

    from resihp_adapters.deepspeed.launch import write_launch_report
    from resihp_core.faults import load_scenario
    from resihp_core.protocols import IterationMetrics
    from resihp_core.protocols.events import PlanPosted

    faults = load_scenario([{"device": 3, "iteration": 3, "kind": "kill"}])
    recs = [IterationMetrics(iteration=i, loss=1.0 - 0.1 * i, seconds=9.0 if i == 0 else 0.1, samples=32,
                            generation=int(i >= 3), phase="after kill on device 3" if i >= 3 else "healthy")
            for i in range(6)]
    plan_ev = PlanPosted(text="generation 1", plan="", kind_of_plan="dp", iteration=3, generation=1)
    out = write_launch_report(tmp_path, SimpleNamespace(records=recs, job_events=[plan_ev]), faults, "ds demo")
    assert out.parent == tmp_path and out.name.startswith("demo-deepspeed-")
    assert sorted(p.name for p in out.iterdir()) == ["events.json", "iteration_time.png", "loss.png",
                                                      "summary.md", "throughput.png"]
    rec = json.loads((out / "events.json").read_text())
    assert [r["iteration"] for r in rec["iterations"]] == [1, 2, 3, 4, 5]
    kinds = {e["kind"] for e in rec["events"]}
    assert {"plan", "injection", "start-up"} <= kinds
    assert [p["phase"] for p in rec["phases"]] == ["healthy", "after kill on device 3"]


@pytest.mark.parametrize("kind", ["json WarmupLR", "factory LambdaLR", "none"])
def test_an_idle_rank_gets_the_lr_of_the_jobs_step_from_its_held_state(kind):
    """A rank idle in its generation answers ``get_lr()`` from the optimizer groups and
    scheduler state it held when it went idle, stepped once per step committed since:
    the LR the working ranks' schedulers give (idle.py)."""
    from types import SimpleNamespace

    from deepspeed.runtime.lr_schedules import WarmupLR

    from resihp_adapters.deepspeed.idle import held_lr
    from resihp_adapters.deepspeed.state import GLOBAL

    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w], lr=2e-3, weight_decay=0.01)
    warm = {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 15}
    factory = (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 15)))
    sched = {"json WarmupLR": lambda: WarmupLR(opt, **warm), "factory LambdaLR": lambda: factory(opt),
             "none": lambda: None}[kind]()
    config = {"scheduler": {"type": "WarmupLR", "params": warm}} if kind == "json WarmupLR" else {}
    spec = SimpleNamespace(lr_scheduler=factory if kind == "factory LambdaLR" else None)
    for _ in range(4):  # four steps before going idle
        opt.step()
        if sched is not None:
            sched.step()
    held = {GLOBAL: {"groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                     "lr_scheduler": ({k: v for k, v in sched.state_dict().items() if not callable(v)}
                                      if sched is not None else None),
                     "counters": {"global_steps": 4, "global_samples": 0, "skipped_steps": 0}}}
    for _ in range(3):  # the job commits three more while this rank idles
        opt.step()
        if sched is not None:
            sched.step()
    want = [g["lr"] for g in opt.param_groups]
    assert held_lr(held, 7, spec, config) == want
    if sched is not None:
        assert held_lr(held, 4, spec, config) != want  # the step count matters


def test_groups_of_an_ended_generation_outlive_the_waits_abandoned_in_them():
    """A gloo group's destructor joins its worker threads with the GIL held, so a group
    dropped while an abandoned collective still runs in it would stall the process: the
    groups stay referenced until every wait abandoned at teardown has ended."""
    import threading

    from resihp_adapters.deepspeed import engine

    release = threading.Event()
    waiter = threading.Thread(target=release.wait, daemon=True)
    waiter.start()
    group, other = object(), object()
    engine.ABANDONED.append(waiter)
    try:
        engine.retire_groups([group])
        engine.reap_retired()
        assert any(group in g for g, _ in engine.RETIRED)  # the wait still runs: kept
        release.set()
        waiter.join(5)
        engine.reap_retired()
        assert not any(group in g for g, _ in engine.RETIRED) and waiter not in engine.ABANDONED
        engine.retire_groups([other])  # nothing abandoned: dropped at once, as before
        assert not any(other in g for g, _ in engine.RETIRED)
    finally:
        release.set()
        engine.RETIRED.clear()
        if waiter in engine.ABANDONED:
            engine.ABANDONED.remove(waiter)


def test_the_clip_norm_keeps_the_initial_stage_count_after_a_shrink():
    """DeepSpeed's clip norm counts the initial stage 0's layers: the adapter keeps that
    stage count when a later plan has fewer stages, and refuses, with clipping on, when
    it cannot know it (a worker whose first plan is a later generation, no resihp.pp).
    DeepSpeed's checkpoint format is refused on the smaller layout for the same reason."""
    from types import SimpleNamespace

    from resihp_core.config import ConfigError

    from resihp_adapters.deepspeed.adapter import DeepSpeedAdapter

    def adapter(resihp: dict, clip: float) -> SimpleNamespace:
        a = SimpleNamespace(_initial_pp=None, spec=SimpleNamespace(resihp=resihp), plan=None,
                            config={"gradient_clipping": clip}, ctx=SimpleNamespace(device=3))
        a._launch_stages = lambda: DeepSpeedAdapter._launch_stages(a)
        return a

    def enter(a: SimpleNamespace, pp: int, generation: int) -> int:
        a.plan = ParallelPlan.uniform(tp=1, pp=pp, dp=1, num_layers=6, num_microbatches=2)
        return DeepSpeedAdapter.initial_stages(a, generation)

    a = adapter({}, 0.02)
    assert [enter(a, 2, 0), enter(a, 1, 3)] == [2, 2]  # generation 0's count, kept on one stage
    assert enter(adapter({"pp": 3}, 0.02), 1, 4) == 3  # resihp launch's config says it
    assert enter(adapter({"num_layers": 6}, 0.02), 1, 4) == 2  # ... or its default
    with pytest.raises(ConfigError, match="resihp.pp") as e:
        enter(adapter({}, 0.02), 1, 4)
    assert "device 3" in str(e.value) and "generation 4" in str(e.value)
    assert enter(adapter({}, 0.0), 1, 4) == 1  # no clipping: the norm is never used

    # DeepSpeed's own checkpoint format describes the initial layout: refused on one stage.
    a = adapter({}, 0.0)
    enter(a, 2, 0)
    a.xplan, a.zero_stage, a.ctx.job = a.plan, 0, SimpleNamespace(dp=1)
    a.initial_ranges = lambda pp: ParallelPlan.uniform(tp=1, pp=pp, dp=1, num_layers=6,
                                                       num_microbatches=2).layer_ranges
    DeepSpeedAdapter.check_initial_layout(a, "save_checkpoint")
    a.xplan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=6, num_microbatches=2)
    with pytest.raises(RuntimeError, match=r"save_checkpoint .*layers \[\(0, 6\)\].*initial \[\(0, 3\), \(3, 6\)\]"):
        DeepSpeedAdapter.check_initial_layout(a, "save_checkpoint")


def test_the_rollback_snapshot_reuses_its_buffers_and_holds_exactly_the_units():
    """The snapshot taken before every iteration is written into the previous one's
    buffers: the same values as a fresh extraction (parameters, AdamW moments and step
    counts, a tied group, hyperparameters, LR scheduler, counters), copies rather than
    views of the engine's tensors, and a rollback to it puts the engine back exactly."""
    from types import SimpleNamespace

    from resihp_adapters.deepspeed.state import apply_units, extract_units, snapshot_units

    torch.manual_seed(0)
    layers = {3: torch.nn.Linear(6, 5), 4: torch.nn.Sequential(torch.nn.LayerNorm(5), torch.nn.Linear(5, 4))}
    tied = torch.nn.Embedding(7, 6)
    params = [p for m in (*layers.values(), tied) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    module = SimpleNamespace(_local_start=3, _local_stop=5, local_layers=lambda: layers,
                             tied_modules={"embed": tied})
    engine = SimpleNamespace(module=module, basic_optimizer=opt, optimizer=opt, lr_scheduler=sched,
                             global_steps=0, global_samples=0, skipped_steps=0)

    def train_step() -> None:
        x = tied(torch.randint(7, (3,)))
        layers[4](layers[3](x)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        engine.global_steps += 1
        engine.global_samples += 3

    def same(a: object, b: object) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    def tensors(tree: object) -> list[torch.Tensor]:
        if isinstance(tree, torch.Tensor):
            return [tree]
        vals = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
        return [t for v in vals for t in tensors(v)]

    train_step()
    first = snapshot_units(engine)  # no buffers yet: fresh copies
    assert same(first, extract_units(engine))
    train_step()
    want = extract_units(engine)
    buffers = [t.data_ptr() for t in tensors(first)]
    second = snapshot_units(engine, first)
    assert same(second, want)
    assert [t.data_ptr() for t in tensors(second)] == buffers  # written into the earlier snapshot's buffers
    live = {t.data_ptr() for t in tensors(extract_units(engine, copy=False))}
    assert not live & set(buffers)  # copies, not views of the engine's tensors
    train_step()
    train_step()
    assert same(second, want)  # training on leaves the snapshot alone
    apply_units(engine, second)  # the rollback
    assert same(extract_units(engine), want)
    # Buffers of another structure (a snapshot in which unit 3 held nothing): fresh copies.
    other = {**first, 3: {"params": {}, "opt": {}}}
    third = snapshot_units(engine, other)
    assert same(third, extract_units(engine)) and not {t.data_ptr() for t in tensors(third)} & set(buffers)


def test_the_layer_seed_leaves_every_generator_as_deepspeeds_own_does():
    """``seed_layer`` (the adapter's ``PipelineModule`` seeding, once per layer and
    micro-batch) leaves Python's, NumPy's and torch's generators where DeepSpeed's
    ``set_random_seed`` leaves them: the same dropout draws, without torch's per-call
    stack capture for accelerators that are not started."""
    import random

    import numpy
    from deepspeed.runtime.utils import set_random_seed

    from resihp_adapters.deepspeed.engine import seed_layer

    def states() -> tuple:
        return random.getstate(), numpy.random.get_state()[1].tolist(), torch.get_rng_state()

    for seed in (0, 1234 * 7 + 3, 2**40 + 5, 2**64 + 9):
        set_random_seed(seed)
        want = states()
        random.random(), numpy.random.rand(), torch.rand(3)  # move every generator on
        seed_layer(seed)
        got = states()
        assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2]), seed


def test_two_deep_rollback_to_puts_back_the_state_before_either_iteration_in_reused_buffers():
    """With ``keep_snapshots(2)`` (the worker's overlapped commit) a refused commit of
    iteration 5 after 6 has stepped goes back to the exact state before 5: parameters,
    AdamW moments and step counts, a tied group, hyperparameters, LR scheduler and the
    engine's counters; the snapshots' buffers rotate (none allocated per iteration), and
    an iteration no snapshot holds is refused naming the kept ones."""
    from types import SimpleNamespace

    from resihp_adapters.deepspeed.adapter import DeepSpeedAdapter
    from resihp_adapters.deepspeed.state import _tensor_leaves, extract_units

    from resihp_core.runtime.worker import DeepRollback

    torch.manual_seed(0)
    layers = {3: torch.nn.Linear(6, 5), 4: torch.nn.Sequential(torch.nn.LayerNorm(5), torch.nn.Linear(5, 4))}
    tied = torch.nn.Embedding(7, 6)
    params = [p for m in (*layers.values(), tied) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    module = SimpleNamespace(_local_start=3, _local_stop=5, local_layers=lambda: layers,
                             tied_modules={"embed": tied})

    def train_batch() -> torch.Tensor:  # one DeepSpeed step of this toy stage, data by iteration
        x = tied(torch.randint(7, (3,), generator=torch.Generator().manual_seed(engine.iteration)))
        loss = layers[4](layers[3](x)).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        engine.global_steps += 1
        return loss.detach()

    engine = SimpleNamespace(module=module, basic_optimizer=opt, optimizer=opt, lr_scheduler=sched, global_steps=0,
                             global_samples=0, skipped_steps=0, train_batch=train_batch, timings=[],
                             is_last_stage=lambda: False, total_loss=None)
    a = DeepSpeedAdapter.__new__(DeepSpeedAdapter)
    a.__dict__.update(ctx=SimpleNamespace(device=2, job=SimpleNamespace(dp=1, num_microbatches=1)),
                      spec=SimpleNamespace(micro_batch_size=3), engine=engine, _snaps=[], _depth=1, _spare=None,
                      _build=1, _program=object(), _sdc=None, _held={})
    plan = SimpleNamespace(location=lambda device: (0, 0, 0))
    a.plan = a.xplan = plan
    assert isinstance(a, DeepRollback) and a.keep_snapshots(2)

    def same(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return type(x) is type(y) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        return x == y

    def step(i: int) -> None:  # the worker: snapshot, then the iteration
        a.snapshot()
        a.run_iteration(None, i)

    step(4)
    before_5 = extract_units(engine)
    step(5)
    before_6 = extract_units(engine)
    step(6)
    buffers = {t.data_ptr() for s in a._snaps for t in _tensor_leaves(s.units, [])}
    a.rollback_to(5)  # 5's commit refused while 6 had stepped: both undone
    assert same(extract_units(engine), before_5) and engine.global_steps == 5
    step(5)  # trained again: the same two buffers serve
    assert same(extract_units(engine), before_6)
    step(6)
    a.rollback_to(6)  # 5 committed, 6 refused: one step back
    assert same(extract_units(engine), before_6)
    step(6)
    assert {t.data_ptr() for s in a._snaps for t in _tensor_leaves(s.units, [])} == buffers
    with pytest.raises(RuntimeError, match=r"no snapshot of iteration 4 .*kept: \[5, 6\]"):
        a.rollback_to(4)
    a.keep_snapshots(1)
    step(7)
    with pytest.raises(RuntimeError, match=r"no snapshot of iteration 6"):
        a.rollback_to(6)


def test_a_checkpoint_is_sealed_only_once_every_writer_finished(tmp_path):
    """The background writer of DeepSpeed's checkpoints: writer rank 0 seals only after
    every writer's record is there, with exactly their files; a writer that never
    finishes (killed mid-write) or one that failed leaves the folder unsealed, and the
    restore rule skips it."""
    from resihp_core import checkpoints
    from resihp_adapters.torchkit.checkpoint import SealedWriter

    root = str(tmp_path)
    w0, w1 = SealedWriter(seal_timeout_s=0.3), SealedWriter(seal_timeout_s=0.3)
    x = {"w": torch.arange(4.0)}
    for w, r in ((w0, 0), (w1, 1)):
        w.submit(3, root, {f"layers/u{r}-tp0.pt": x, "layers/global-tp0.pt": {"lr": 0.1}}, generation=0, rank=r,
                 writers=2, keep=0)
    assert w0.drain(5) and w1.drain(5)
    assert checkpoints.verify(root, 3).complete
    assert set(json.loads((checkpoints.iteration_dir(root, 3) / checkpoints.MANIFEST).read_text())["files"]) == {
        "layers/u0-tp0.pt", "layers/u1-tp0.pt", "layers/global-tp0.pt"}
    assert not list(checkpoints.iteration_dir(root, 3).glob("written-*"))
    assert [r.error for r in w0.results()] == [None] and w1.results() == []
    # Iteration 7: writer 1 dies before its files are written; iteration 11: its write fails.
    w0.submit(7, root, {"layers/u0-tp0.pt": x}, generation=1, rank=0, writers=2, keep=0)
    assert w0.drain(5)
    w1.before_write = lambda i: (_ for _ in ()).throw(OSError("disk full"))
    for w, r in ((w0, 0), (w1, 1)):
        w.submit(11, root, {f"layers/u{r}-tp0.pt": x}, generation=1, rank=r, writers=2, keep=0)
    assert w0.drain(5) and w1.drain(5)
    assert not checkpoints.verify(root, 7).complete and not checkpoints.verify(root, 11).complete
    assert [r.error for r in w1.results()] == ["OSError: disk full"]
    assert "writer 1: OSError: disk full" in w0.results()[0].error
    assert checkpoints.restore_point(root, 12, 4, grace_s=0)[0] == 3
