"""torch_native pieces that need no processes: lowering, shard arithmetic, transfer plans,
configuration errors, lazy registration."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from resihp_core.plan import Migration, ParallelPlan  # noqa: E402
from resihp_core.predictor.schedules import emit_programs  # noqa: E402
from resihp_adapters.torch_native.adapter import parse_config  # noqa: E402
from resihp_adapters.torch_native.engine import place_of, shard_degree_for  # noqa: E402
from resihp_adapters.torch_native.lowering import LoweringError, lower_pipeline, lower_program  # noqa: E402
from resihp_adapters.torch_native.model import LlamaConfig, build_stage  # noqa: E402
from resihp_adapters.torch_native.reshard import StateLost, chunk_rows, full_shapes, transfer_plan  # noqa: E402

HERE = Path(__file__).resolve().parent
CFG = LlamaConfig(vocab_size=32, dim=8, n_layers=4, n_heads=2, ffn_dim=16)


def plan(pp=2, dp=2, m=4, schedule="1f1b") -> ParallelPlan:
    return ParallelPlan.uniform(tp=1, pp=pp, dp=dp, num_layers=4, num_microbatches=m, schedule=schedule)


def test_1f1b_program_lowers_to_torch_actions_in_order():
    p = {(q.replica, q.stage): q for q in emit_programs(plan())}
    first = [str(a) for a in lower_program(p[(1, 0)])]
    assert first[:4] == ["0UNSHARD", "0F0", "0SEND_F0", "0F1"]
    assert first[-3:] == ["0B3", "0REDUCE_GRAD", "0RESHARD"]
    last = [str(a) for a in lower_program(p[(1, 1)])]
    assert last[:4] == ["1UNSHARD", "1RECV_F0", "1F0", "1B0"]
    assert "1SEND_B0" in last


def test_zbh1_splits_backward_into_input_and_weight():
    acts = [str(a) for a in lower_program(emit_programs(plan(schedule="zbh1"))[0])]
    assert any(a.endswith("I0") for a in acts) and any(a.endswith("W0") for a in acts)


def test_runtime_accepts_the_lowered_pipeline():
    from torch.distributed.pipelining.schedules import _validate_schedule

    acts = lower_pipeline(emit_programs(plan()), replica=0)
    assert _validate_schedule(acts, 2, 2, 4) == {0: 0, 1: 1}


def test_migrated_work_is_refused_with_the_reason():
    p = plan().with_(migrations=(Migration(1, 1, 3, 0),))
    prog = next(q for q in emit_programs(p) if (q.replica, q.stage) == (0, 1))
    with pytest.raises(LoweringError, match="replica 1 .*one replica's pipeline"):
        lower_program(prog)


def test_whole_micro_batches_of_another_replica_lower_to_uneven_counts_per_pipeline():
    """pp2 x dp2: every stage of (replica 1, mb 3) runs on replica 0, whose pipeline then
    runs 5 micro-batches (runtime indices 0..4 in its work order) and replica 1's 3;
    torch's own validator accepts both groups' lists."""
    from torch.distributed.pipelining.schedules import _validate_schedule

    from resihp_adapters.torch_native.engine import check_plan

    p = plan().with_(migrations=(Migration(0, 1, 3, 0), Migration(1, 1, 3, 0)))
    check_plan(p)
    for r, n in ((0, 5), (1, 3)):
        work = p.work(r, 0)
        assert len(work) == n and work == p.work(r, 1)
        acts = lower_pipeline(emit_programs(p), r, {w: k for k, w in enumerate(work)})
        assert _validate_schedule(acts, 2, 2, n) == {0: 0, 1: 1}
    k = p.work(0, 0).index((1, 3))
    assert f"1F{k}" in [str(a) for a in acts_of(p, 0, 1)]
    with pytest.raises(LoweringError, match="index of the replica's work"):
        lower_program(next(q for q in emit_programs(p) if (q.replica, q.stage) == (0, 0)))
    with pytest.raises(ValueError, match="only whole"):
        check_plan(plan().with_(migrations=(Migration(1, 1, 3, 0),)))


def acts_of(p: ParallelPlan, r: int, s: int) -> list:
    work = p.work(r, s)
    return lower_program(next(q for q in emit_programs(p) if (q.replica, q.stage) == (r, s)),
                         {w: k for k, w in enumerate(work)})


def test_a_dropped_replica_takes_no_part_in_fsdp():
    """dp4, replica 1 dropped (its micro-batches run whole elsewhere): the other three
    are FSDP slots 0..2 (world ranks, shard coordinates); a replica with devices but no
    work is refused (FSDP's reduction needs its backward)."""
    from resihp_adapters.torch_native.engine import check_plan, live_replicas

    base = plan(pp=1, dp=4, m=2)
    groups = tuple(((),) if r == 1 else rep for r, rep in enumerate(base.tp_groups))
    p = base.with_(tp_groups=groups, excluded=frozenset({1}),
                   migrations=(Migration(0, 1, 0, 0), Migration(0, 1, 1, 2)))
    check_plan(p)
    assert live_replicas(p) == [0, 2, 3]
    got = {d: (pl.rank, pl.replica, pl.slot, pl.shard_degree, pl.shard_index)
           for d in (0, 2, 3) for pl in [place_of(p, d, 0)]}
    assert got == {0: (0, 0, 0, 3, 0), 2: (1, 2, 1, 3, 1), 3: (2, 3, 2, 3, 2)}
    assert place_of(p, 3, 1).shard_degree == 1 and place_of(p, 3, 1).replicate_index == 2
    idle = base.with_(migrations=(Migration(0, 3, 0, 0), Migration(0, 3, 1, 1)))
    with pytest.raises(ValueError, match="replica 3 has devices but no micro-batch"):
        check_plan(idle)


def test_shard_degree_and_places():
    assert [shard_degree_for(4, k) for k in (0, 1, 2, 3, 4, 8)] == [4, 1, 2, 2, 4, 4]
    assert shard_degree_for(3, 2) == 1
    p = plan()
    pl = place_of(p, 3, 1)  # device 3: replica 1, stage 1
    assert (pl.rank, pl.replica, pl.stage, pl.shard_degree, pl.replicate_index) == (3, 1, 1, 1, 1)


def test_chunk_rows_follow_torch_chunk():
    assert chunk_rows(10, 4) == [3, 3, 3, 1]
    assert chunk_rows(5, 4) == [2, 2, 1, 0]
    assert chunk_rows(2, 4) == [1, 1, 0, 0]
    assert sum(chunk_rows(7, 3)) == 7


def test_stage_names_are_split_independent_and_weights_seeded():
    whole = dict(build_stage(CFG, 0, 4).named_parameters())
    a, b = build_stage(CFG, 0, 1), build_stage(CFG, 1, 4)
    parts = {**dict(a.named_parameters()), **dict(b.named_parameters())}
    assert set(parts) == set(whole) == set(full_shapes(CFG))
    assert all(torch.equal(parts[n], whole[n]) for n in whole)


def test_a_stage_built_for_state_has_the_seeded_stages_structure_without_its_initialisation():
    """``init=False`` (a re-split stage whose every parameter is copied in next) skips
    the two initialisation passes, never the structure: same names, shapes and dtypes,
    no buffer left uninitialised."""
    for a, b in ((0, 2), (1, 3), (2, 4)):
        seeded, empty = build_stage(CFG, a, b), build_stage(CFG, a, b, init=False)
        assert [(n, p.shape, p.dtype, p.device) for n, p in seeded.named_parameters()] == [
            (n, p.shape, p.dtype, p.device) for n, p in empty.named_parameters()]
        assert not list(empty.buffers()) and not any(p.is_meta for p in empty.parameters())


def test_transfer_plan_sources_from_a_surviving_copy_or_reports_the_lost_shard():
    old = plan()  # devices: r0s0=0, r1s0=1, r0s1=2, r1s1=3
    new = ParallelPlan(num_layers=4, layer_ranges=((0, 1), (1, 2), (2, 4)),
                       tp_groups=(((0,), (2,), (3,)),), num_microbatches=8)
    trs = transfer_plan(CFG, old, new, {0, 2, 3}, wanted_shard=1)  # HSDP: whole copies
    assert all(t.of == 1 for t in trs)
    assert {t.src for t in trs if t.dst == 2 and t.name.startswith("layers.1.")} == {0}
    assert all(t.src == t.dst for t in trs if t.dst in (0, 3))
    with pytest.raises(StateLost, match="shard 1/2 of stage 0"):
        transfer_plan(CFG, old, new, {0, 2, 3}, wanted_shard=0)  # FSDP2: half of stage 0 died


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="unknown field.*'tp'"):
        parse_config({"tp": 2})
    with pytest.raises(ValueError, match="adapter_config.shard"):
        parse_config({"shard": -1})
    with pytest.raises(ValueError, match="LlamaConfig.dtype"):
        parse_config({"model": {"dtype": "float16"}})
    with pytest.raises(ValueError, match="adapter_config.data: torch_native trains on the job's data source"):
        parse_config({"data": {"seq_len": 3}})
    c = parse_config({"model": {"n_layers": 2}, "shard": 1}, seed=7)
    assert c["model"].seed == 7 and c["shard"] == 1


DATA = {"source": "synthetic", "token_budget": 16, "scale": 3.0, "min_len": 2, "max_len": 16}


def batches(dp=2, m=4):
    from resihp_core.data import create_source
    from resihp_adapters.torch_native.data import Batches

    return Batches(create_source(DATA, dp=dp, num_microbatches=m, seed=3, vocab_size=32))


def test_micro_batches_come_from_the_job_source_addressed_like_the_global_batch():
    b = batches()
    src = b.source
    assert b.global_microbatches == 8
    # plan micro-batch (owner, mb) of a plan with m per replica = global owner * m + mb
    assert b.address(1, 2, 4) == (1, 2) and b.address(0, 6, 8) == (1, 2) and b.address(0, 3, 8) == (0, 3)
    with pytest.raises(ValueError, match="outside the job's global batch of 8"):
        b.address(2, 0, 4)
    mb = b.micro_batch(5, 1, 2, 4)
    lengths = src.lengths(5, 1, 2)
    assert mb.lengths == tuple(lengths) and sum(lengths) == 16
    assert mb.tokens[0].tolist() == list(src.tokens(5, 1, 2))
    # labels: next token inside each piece, none at a piece's last token
    ends = set(torch.cumsum(torch.tensor(lengths), 0).sub(1).tolist())
    for i in range(16):
        want = -100 if i in ends else int(mb.tokens[0, i + 1])
        assert int(mb.labels[0, i]) == want
    assert b.label_count(5) == sum(16 - len(src.lengths(5, r, j)) for r in range(2) for j in range(4))
    # positions restart and attention stays inside each document
    start = 0
    for n in lengths:
        assert mb.pos[0, start:start + n].tolist() == list(range(n))
        assert bool(mb.mask[0, start + n - 1, start:start + n].all())
        if start:
            assert not bool(mb.mask[0, start, :start].any())
        start += n
    assert not bool(mb.mask[0].triu(1).any())


def test_document_mask_makes_documents_independent():
    """A token's output depends only on earlier tokens of its own document."""
    from resihp_adapters.torch_native.data import document_mask, positions
    from resihp_adapters.torch_native.model import build_stage

    model = build_stage(CFG, 0, 4)
    lengths = (3, 5)
    x = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = {"pos": positions(lengths, torch.float64)[None], "mask": document_mask(lengths)[None]}
    y = model(x, **kw)
    x2 = x.clone()
    x2[0, :3] = (x2[0, :3] + 1) % 32  # change only the first document
    y2 = model(x2, **kw)
    assert torch.equal(y[0, 3:], y2[0, 3:])
    # the second document alone gives the same outputs as inside the pack
    alone = model(x[:, 3:])
    assert torch.allclose(alone[0], y[0, 3:], rtol=1e-12, atol=1e-14)


def test_accelerate_config_picks_the_adapter(tmp_path):
    pytest.importorskip("accelerate")
    from resihp_adapters.launch import framework_of

    ds = str(HERE.parents[1] / "examples" / "deepspeed_pipeline" / "accelerate.yaml")
    fsdp = str(HERE.parents[1] / "examples" / "torch_native" / "accelerate.yaml")
    assert framework_of(ds) == "deepspeed" and framework_of(fsdp) == "torch_native"
    v1 = tmp_path / "v1.yaml"
    v1.write_text(Path(fsdp).read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    with pytest.raises(ValueError, match="fsdp_config.fsdp_version is 1"):
        framework_of(str(v1))
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    with pytest.raises(ValueError, match="distributed_type is MULTI_GPU"):
        framework_of(str(gpu))


def test_launch_settings_take_the_layout_from_accelerate(tmp_path):
    from resihp_core.config import ConfigError
    from resihp_adapters.torch_native.launch import settings

    example = HERE.parents[1] / "examples" / "torch_native" / "resihp.toml"
    cfg = settings(example, processes=4)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp) == (1, 2, 2)
    assert cfg.runtime.adapter == "torch_native" and cfg.runtime.nodes * cfg.runtime.devices_per_node == 4
    cfg8 = settings(example, processes=8)
    assert cfg8.parallel.dp == 4
    tp = tmp_path / "tp.toml"
    tp.write_text("[parallel]\npp = 2\ntp = 2\n")
    assert (settings(tp, processes=4).parallel.tp, settings(tp, processes=4).parallel.dp) == (2, 1)
    for text, field in (("[parallel]\ntp = 2\npp = 1\n", "parallel.tp"), ("[parallel]\npp = 3\n", "parallel.pp"),
                        ("[parallel]\npp = 2\ndp = 3\n", "parallel.dp"),
                        ("[runtime]\nadapter = 'deepspeed'\n", "runtime.adapter")):
        f = tmp_path / "bad.toml"
        f.write_text(text)
        with pytest.raises(ConfigError) as e:
            settings(f, processes=4)
        assert e.value.path == field, (text, e.value)


def test_registration_is_lazy():
    import subprocess

    code = ("import sys; from resihp_core.plugins import Plugins; "
            "spec = Plugins().adapters().get('torch_native'); "
            "assert spec.capabilities.layer_repartition and not spec.capabilities.cross_replica_migration; "
            "assert 'torch' not in sys.modules, 'registration imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resihp_plugins_lists_the_adapter_with_its_capabilities(capsys):
    import json

    from resihp_core.cli import main

    assert main(["plugins", "--json"]) == 0
    rep = {a["name"]: a for a in json.loads(capsys.readouterr().out)["adapters"]}
    caps = rep["torch_native"]["capabilities"]
    assert caps == {"tp_resize": True, "heterogeneous_tp": True, "layer_repartition": True,
                    "cross_replica_migration": False, "schedules": ["1f1b", "gpipe", "zbh1"],
                    "checkpoint": True, "uneven_dp": True, "tp_with_dp": False, "sdc_fingerprint": True,
                    "restage": True, "memory_copy": False}
