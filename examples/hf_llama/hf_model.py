"""The pieces a Hugging Face user brings, small enough for a CPU: a tiny causal LM built
from a config (random init, nothing downloaded), a dataset over local text, AdamW, a
warm-up + cosine LR schedule. ``train.py`` hands them to ResiHP's ``initialize``; the
tests build the same ones."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def tiny_model(kind: str = "llama", *, layers: int = 4, dtype: torch.dtype = torch.float64, seed: int = 0,
               vocab: int = 256) -> torch.nn.Module:
    """``llama``: grouped-query attention (4 heads, 2 KV heads), tied embeddings;
    ``qwen2``: biased q/k/v projections, untied head. Seeded random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        raise ValueError(f"model kind {kind!r}: llama or qwen2")
    return model.to(dtype)


class TextWindows(torch.utils.data.Dataset):
    """Byte-level windows of ``seq_len`` tokens over a local text file (vocabulary 256)."""

    def __init__(self, path: str | Path, seq_len: int = 16) -> None:
        data = Path(path).read_bytes()
        self.tokens = torch.tensor(list(data), dtype=torch.int64)
        self.seq_len = seq_len
        if len(self.tokens) < seq_len:
            raise ValueError(f"{path}: shorter than one window of {seq_len} bytes")

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i * self.seq_len:(i + 1) * self.seq_len]
        return {"input_ids": ids, "labels": ids.clone()}


def adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, foreach=False)


def warmup_cosine(total: int, warmup: int = 3):
    """LambdaLR factory: linear warm-up, then cosine decay to 10 %."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)


def user_llama(iterations: int = 1000):  # noqa: ANN201 - resihp_adapters.torch_native.api.UserJob
    """The whole user job as ``adapter_config.user = "hf_model:user_llama"`` names it
    (``resihp run``, benchmarks): this folder's model, optimizer, schedule, clipping and
    README as the text."""
    from resihp_adapters.torch_native.api import user_job

    return user_job(tiny_model("llama"), optimizer=adamw, lr_scheduler=warmup_cosine(iterations), max_grad_norm=1.0,
                    dataset=TextWindows(Path(__file__).resolve().parent / "README.md", 16), micro_batch_size=2)
