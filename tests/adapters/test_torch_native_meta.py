"""A model on the meta device (docs/torch_native.md, "Models on the meta device"): each
stage materialises only what it holds, and equals materialising the whole model and
cutting the stage out of it; initialised by the model's own rule. One process."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from resihp_adapters.torch_native.split import Split, Stage, UserStages  # noqa: E402


def _hf(kind: str, meta: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.05, dtype=torch.float64)
    cls, cfg = ((LlamaForCausalLM, LlamaConfig(**common, tie_word_embeddings=True)) if kind == "llama" else
                (Qwen2ForCausalLM, Qwen2Config(**common, tie_word_embeddings=False)))
    with torch.device("meta" if meta else "cpu"):
        return cls(cfg).to(torch.float64)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)}
    out.update({n: b for n, b in module.named_buffers()})
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_each_stage_materialises_what_it_holds_equal_to_the_whole_model_cut(kind):
    model = _hf(kind, meta=True)
    stages = UserStages(model)
    assert stages.meta and all(p.is_meta for p in model.parameters())  # the user's model stays on meta
    whole = stages.build_whole()
    assert not any(t.is_meta for t in _tensors(whole).values())
    cut = Stage(stages.split, whole, 0, 4)  # the whole model, materialised, then split
    want = _tensors(cut)
    for a, b in [(0, 1), (1, 3), (3, 4), (0, 2), (2, 4), (0, 4)]:
        got = _tensors(stages.build(a, b))
        assert set(got) <= set(want), (a, b)
        for name, t in got.items():
            assert t.dtype == want[name].dtype and torch.equal(t, want[name]), (kind, a, b, name)
    # by the model's own rule: HF's _init_weights (normal(0, initializer_range) weights,
    # zero biases, unit norms, the rotary frequencies of a model built for real)
    real = _tensors(_hf(kind, meta=False))
    std = float(torch.cat([want[n].flatten() for n in want if n.endswith("proj.weight")]).std())
    assert abs(std - 0.05) < 0.005, std
    for name, t in want.items():
        if "norm" in name:
            assert torch.equal(t, torch.ones_like(t)), name
        if name.endswith(".bias"):
            assert torch.equal(t, torch.zeros_like(t)), name
        if "rotary_emb" in name:
            assert torch.equal(t, real[name].to(t.dtype)), name
    if kind == "llama":  # tied: the last stage's head holds the first stage's embedding values
        last, first = _tensors(stages.build(2, 4)), _tensors(stages.build(0, 2))
        assert torch.equal(last["lm_head.weight"], first["model.embed_tokens.weight"])
        both = stages.build(0, 4)
        assert both.part("lm_head").weight is both.part("model.embed_tokens").weight


def test_the_seed_decides_the_weights_and_nothing_else():
    a = _tensors(UserStages(_hf("llama", meta=True), seed=0).build(1, 3))
    torch.manual_seed(1234)  # the global RNG state does not matter, nor is it changed
    state = torch.random.get_rng_state()
    b = _tensors(UserStages(_hf("llama", meta=True), seed=0).build(1, 3))
    assert torch.equal(torch.random.get_rng_state(), state)
    c = _tensors(UserStages(_hf("llama", meta=True), seed=1).build(1, 3))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.layers.1.mlp.up_proj.weight"], c["model.layers.1.mlp.up_proj.weight"])


class _Scale(nn.Module):
    """Holds a parameter and has no reset_parameters: nothing could initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))


class _Net(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = _Scale() if extra else nn.Linear(4, 16)


def _split() -> Split:
    return Split(pre=("emb",), blocks=("blocks.0", "blocks.1", "blocks.2"), post=("head",),
                 embed=lambda st, x, kw: st.part("emb")(x), block=lambda m, h, ctx: m(h),
                 head=lambda st, h: st.part("head")(h))


def test_other_models_use_reset_parameters_and_a_module_without_one_is_refused():
    with torch.device("meta"):
        net, bad = _Net(extra=False), _Net(extra=True)
    stages = UserStages(net, _split())
    want = _tensors(Stage(stages.split, stages.build_whole(), 0, 3))
    got = {**_tensors(stages.build(0, 1)), **_tensors(stages.build(1, 3))}
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert float(want["blocks.1.weight"].abs().max()) <= 0.5  # nn.Linear's own bound: 1 / sqrt(4)
    with pytest.raises(ValueError, match=r"module 'head' \(_Scale\) .* no reset_parameters"):
        UserStages(bad, _split())
