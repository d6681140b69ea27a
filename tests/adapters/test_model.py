"""Reference model: per-document attention, stage splitting and exact tensor parallelism."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from resihp_adapters.megatron_ref.model import (
    IGNORE_INDEX,
    ModelConfig,
    build_model,
    build_stage,
    document_attention,
    init_parameter,
    make_labels,
    shard_state,
    unshard_state,
)

torch.set_num_threads(1)

CONFIG = ModelConfig(vocab_size=64, hidden=32, num_heads=4, ffn_hidden=48, num_layers=4,
                     dtype="float64", seed=3)
LENGTHS = [7, 1, 12, 3, 9]


def _batch(config: ModelConfig = CONFIG, lengths: list[int] = LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, config.vocab_size, (sum(lengths),), generator=gen)
    return tokens, make_labels(tokens, lengths)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def _reference_run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(CONFIG)
    tokens, labels = _batch()
    loss = model(tokens, LENGTHS, labels)
    loss.backward()
    return loss.detach(), _grads(model)


def test_forward_backward_float64() -> None:
    model = build_model(CONFIG)
    tokens, labels = _batch()
    loss = model(tokens, LENGTHS, labels)
    assert loss.dtype == torch.float64
    n_labelled = int((labels != IGNORE_INDEX).sum())
    assert n_labelled == sum(LENGTHS) - len(LENGTHS)
    # Summed loss: near ln(vocab) per labelled token at initialisation.
    assert loss.item() / n_labelled == pytest.approx(math.log(CONFIG.vocab_size), rel=0.05)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_make_labels_stop_at_document_ends() -> None:
    tokens = torch.tensor([10, 11, 12, 20, 21, 30])
    assert make_labels(tokens, [3, 2, 1]).tolist() == [11, 12, -100, 21, -100, -100]
    with pytest.raises(ValueError, match="sum to"):
        make_labels(tokens, [3, 2])


def test_two_stages_match_unsplit_model() -> None:
    ref_loss, ref_grads = _reference_run()
    s0 = build_stage(CONFIG, (0, 2), True, False)
    s1 = build_stage(CONFIG, (2, 4), False, True)
    tokens, labels = _batch()
    h = s0(tokens, LENGTHS)
    h_in = h.detach().requires_grad_()
    loss = s1(h_in, LENGTHS, labels)
    loss.backward()
    h.backward(h_in.grad)
    assert abs(loss.item() - ref_loss.item()) <= 1e-12
    grads = {**_grads(s0), **_grads(s1)}
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=0, atol=1e-12), name


@pytest.mark.parametrize("block", [512, 4])  # 4: long documents span several query blocks
def test_document_attention_equals_dense_masked_reference(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import resihp_adapters.megatron_ref.model as model

    monkeypatch.setattr(model, "ATTENTION_QUERY_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    lengths = [4, 1, 11, 3]
    n, heads, d = sum(lengths), 3, 8
    q, k, v = (torch.randn(n, heads, d, generator=gen, dtype=torch.float64) for _ in range(3))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    idx = torch.arange(n)
    allowed = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~allowed, float("-inf"))
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    assert torch.allclose(document_attention(q, k, v, lengths), dense, rtol=0, atol=1e-12)


def test_layers_move_between_stages() -> None:
    ref_loss, _ = _reference_run()
    s0 = build_stage(CONFIG, (0, 3), True, False)
    s1 = build_stage(CONFIG, (3, 4), False, True)
    s1.add_layer(2, s0.remove_layer(2))
    assert s0.layer_indices() == [0, 1] and s1.layer_indices() == [2, 3]
    tokens, labels = _batch()
    loss = s1(s0(tokens, LENGTHS), LENGTHS, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-12


def test_shard_unshard_roundtrip_and_tp_independent_init() -> None:
    full = {n: init_parameter(CONFIG, n) for n, _ in build_model(CONFIG).named_parameters()}
    shards = [shard_state(full, r, 2) for r in range(2)]
    assert shards[0]["layers.1.wq.weight"].shape == (CONFIG.hidden // 2, CONFIG.hidden)
    assert shards[1]["layers.1.wo.weight"].shape == (CONFIG.hidden, CONFIG.hidden // 2)
    assert shards[0]["embed.weight"].shape == (CONFIG.vocab_size // 2, CONFIG.hidden)
    back = unshard_state(shards)
    for name, t in full.items():
        assert torch.equal(back[name], t), name
    # Same seed, same full weights whatever the stage split.
    stage = build_stage(CONFIG, (2, 4), False, True)
    assert torch.equal(stage.state_dict()["layers.3.w_up.weight"], full["layers.3.w_up.weight"])


def test_bad_tp_degree_is_rejected() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        build_stage(CONFIG, (0, 2), True, False, tp_size=3)
    with pytest.raises(ValueError, match="needs a process group"):
        build_stage(CONFIG, (0, 2), True, False, tp_rank=0, tp_size=2)


_WORKER = textwrap.dedent(
    """
    import sys, datetime, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from resihp_adapters.megatron_ref.model import (
        ModelConfig, build_model, gather_full_state, make_labels)
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    config = ModelConfig(**eval(sys.argv[4]))
    lengths = eval(sys.argv[5])
    model = build_model(config, dist.group.WORLD, rank, 2)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, config.vocab_size, (sum(lengths),), generator=gen)
    loss = model(tokens, lengths, make_labels(tokens, lengths))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    full_grads = gather_full_state(grads, model.tp)
    if rank == 0:
        torch.save({"loss": loss.detach(), "grads": full_grads}, out)
    dist.barrier()
    del model, loss, grads, full_grads  # no object may hold the group past its destruction
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_tp2_matches_tp1(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    out = tmp_path / "tp2.pt"
    port = _free_port()
    cfg = repr({f: getattr(CONFIG, f) for f in CONFIG.__dataclass_fields__})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), str(out), cfg, repr(LENGTHS)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    result = torch.load(out)
    ref_loss, ref_grads = _reference_run()
    assert abs(result["loss"].item() - ref_loss.item()) <= 1e-10
    assert set(result["grads"]) == set(ref_grads)
    for name, g in result["grads"].items():
        assert g.shape == ref_grads[name].shape, name
        assert torch.allclose(g, ref_grads[name], rtol=0, atol=1e-10), name
