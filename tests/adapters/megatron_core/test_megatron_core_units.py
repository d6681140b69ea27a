"""Megatron-Core adapter, one process: what is refused up front (by name), the rank
order of a plan's world, the shard arithmetic of a move."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_adapters.megatron_core import state as st  # noqa: E402
from resihp_adapters.megatron_core.adapter import megatron_rank  # noqa: E402
from resihp_adapters.megatron_core.gpt import gpt_job  # noqa: E402
from resihp_adapters.megatron_core.spec import UnsupportedFeature, check_supported, load_job  # noqa: E402


@pytest.mark.parametrize("where, key, value, named", [
    ("transformer", "virtual_pipeline_model_parallel_size", 2, "interleaved virtual pipeline"),
    ("transformer", "num_moe_experts", 8, "MoE / expert parallelism"),
    ("transformer", "expert_model_parallel_size", 2, "MoE / expert parallelism"),
    ("transformer", "context_parallel_size", 2, "context parallelism"),
    ("transformer", "sequence_parallel", True, "sequence_parallel"),
    ("optimizer", "bf16", True, "mixed precision"),
    ("ddp", "overlap_grad_reduce", True, "overlapped gradient reduction"),
    ("transformer", "hidden_dropout", 0.1, "dropout without CUDA"),
    ("transformer", "pipeline_model_parallel_layout", "Et|tL", "pipeline_model_parallel_layout"),
])
def test_unsupported_features_are_refused_by_name(where, key, value, named):
    job = gpt_job()
    getattr(job, where)[key] = value
    with pytest.raises(UnsupportedFeature, match="megatron_core adapter") as e:
        check_supported(job, cuda=False)
    assert named in str(e.value)


@pytest.mark.parametrize("where", ["optimizer", "ddp"])
def test_the_distributed_optimizer_is_accepted_in_float32_only(where):
    job = gpt_job()
    getattr(job, where)["use_distributed_optimizer"] = True
    check_supported(job, cuda=False)
    job = gpt_job(dtype="float64")
    getattr(job, where)["use_distributed_optimizer"] = True
    with pytest.raises(UnsupportedFeature, match="distributed optimizer with params_dtype torch.float64"):
        check_supported(job, cuda=False)


def test_the_builtin_job_is_accepted_and_dropout_only_refused_without_cuda():
    check_supported(gpt_job(), cuda=False)
    job = gpt_job()
    job.transformer["hidden_dropout"] = 0.1
    check_supported(job, cuda=True)


def test_adapter_section_names_unknown_fields():
    from resihp_core.config import ConfigError

    with pytest.raises(ConfigError, match="hiden"):
        load_job({"hiden": 32})
    assert load_job({"hidden": 48, "num_layers": 2}).transformer["hidden_size"] == 48


def test_megatron_ranks_follow_tp_dp_pp_order():
    plan = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=2)
    ranks = {d: megatron_rank(plan, d) for d in plan.devices()}
    assert sorted(ranks.values()) == list(range(8))
    for d, rank in ranks.items():
        r, s, t = plan.location(d)
        assert rank == t + 2 * (r + 2 * s)


@pytest.mark.parametrize("full, k_src, k_dst", [(8, 2, 1), (8, 1, 2), (12, 2, 4), (12, 4, 2), (12, 3, 2)])
def test_overlaps_tile_every_destination_shard_exactly(full, k_src, k_dst):
    """Re-sharding a dimension from k_src to k_dst: the overlaps cover every destination
    shard once, and copying them reproduces chunk t of the full tensor."""
    import torch

    whole = torch.arange(full)
    src = whole.chunk(k_src)
    for t in range(k_dst):
        dst = torch.full((full // k_dst,), -1)
        for u in range(k_src):
            o = st.overlap(full, u, k_src, t, k_dst)
            if o is not None:
                so, do, n = o
                dst[do:do + n] = src[u][so:so + n]
        assert torch.equal(dst, whole.chunk(k_dst)[t])


def test_layer_names_are_global_and_the_tied_copy_is_the_embedding():
    assert st.canonical("decoder.layers.1.mlp.linear_fc1.weight", 2, False, True) == \
        "decoder.layers.3.mlp.linear_fc1.weight"
    assert st.canonical("output_layer.weight", 2, False, True) == "embedding.word_embeddings.weight"
    assert st.canonical("output_layer.weight", 0, True, True) == "output_layer.weight"
    assert st.component_of("decoder.layers.3.self_attention.linear_qkv.weight") == "layers.3"
    of = st.components_of_stage(True, True)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=2)
    assert of(plan, 0) == ["embed.pos", "embed.word", "layers.0", "layers.1"]
    assert of(plan, 1) == ["embed.word", "head", "layers.2", "layers.3"]


def test_initialize_refuses_before_any_process_group(tmp_path, monkeypatch):
    """The script API's refusals come before torch.distributed starts: a job that is not
    a MegatronJob, torchrun without a ResiHP configuration, and a world that is not
    tp x pp x dp; ``resihp launch`` with neither an accelerate nor a ResiHP configuration."""
    import argparse

    from resihp_core.cli import CliError
    from resihp_core.config import ConfigError
    from resihp_adapters import launch
    from resihp_adapters.megatron_core import initialize

    for var in ("RESIHP_STORE", "RESIHP_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(TypeError, match="not a MegatronJob"):
        initialize({"transformer": {}})
    with pytest.raises(ConfigError, match="RESIHP_CONFIG"):
        initialize(gpt_job())
    cfg = tmp_path / "resihp.toml"
    cfg.write_text("[parallel]\ntp = 1\npp = 2\ndp = 2\n[runtime]\nadapter = \"megatron_core\"\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="WORLD_SIZE = 2 processes, the configuration's tp x pp x dp = 4"):
        initialize(gpt_job(), config=cfg)
    args = argparse.Namespace(config_file=None, resihp_config=None, resume=False)
    with pytest.raises(CliError, match="--resihp_config"):
        launch.run(args)
