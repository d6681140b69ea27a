"""The built-in ``pretrain_gpt``-shaped job: a small ``GPTModel`` (Megatron-Core's local
layer spec, tied embedding and output layer), a synthetic token dataset, a forward step
and loss function written as Megatron-LM's ``pretrain_gpt.py`` writes them, AdamW with
clipping and a warm-up + cosine parameter scheduler. The example, the tests and jobs
without ``adapter.user`` run it; a port of a real script replaces it
(``docs/megatron_core.md``)."""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch

from resihp_adapters.megatron_core.spec import MegatronJob

__all__ = ["gpt_job", "TokenDataset", "model_provider", "forward_step"]


class TokenDataset:
    """Deterministic random token sequences: sample ``i`` is a function of ``i`` alone, so
    any layout reads the same data."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234) -> None:
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        tok = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)
        return {"tokens": tok[:-1], "labels": tok[1:], "loss_mask": torch.ones(self.seq_length)}


def model_provider(vocab_size: int, seq_length: int, config: Any, pre_process: bool = True,
                   post_process: bool = True) -> torch.nn.Module:
    """``pretrain_gpt``'s model provider, the config given (bind the vocabulary and
    sequence length with ``functools.partial``): a GPTModel on the local
    (non-TransformerEngine) layer spec, embedding and output layer tied."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab_size,
                     max_sequence_length=seq_length, pre_process=pre_process,
                     post_process=post_process, share_embeddings_and_output_weights=True)
    # The local spec's torch LayerNorm is made in float32 whatever params_dtype says.
    return model.to(config.params_dtype)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``pretrain_gpt``'s loss: the masked token-loss sum and the token count (Megatron's
    schedule divides one by the other)."""
    losses = output_tensor.view(-1)
    mask = loss_mask.view(-1).to(losses.dtype)
    total = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), mask.sum().detach()])}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
                 ) -> tuple[torch.Tensor, Any]:
    """``pretrain_gpt``'s forward step: next batch, positions, the model with labels."""
    batch = next(data_iterator)
    tokens, labels = batch["tokens"], batch["labels"]
    device = next(model.parameters()).device
    tokens, labels, mask = tokens.to(device), labels.to(device), batch["loss_mask"].to(device)
    position_ids = torch.arange(tokens.size(1), device=device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, mask)


def gpt_job(vocab_size: int = 64, hidden: int = 32, num_heads: int = 4, ffn_hidden: int = 64, num_layers: int = 4,
            seq_length: int = 16, micro_batch_size: int = 2, lr: float = 1e-3, clip_grad: float | None = None,
            dtype: str = "float32", distributed_optimizer: bool = False) -> MegatronJob:
    """The built-in job; keyword arguments are the ``[adapter]`` fields. ``float64``
    trains without clipping (Megatron's clipping takes float32 gradients only); it is how
    the tests hold moved, migrated and restored runs to 1e-9 of the fault-free one.
    ``distributed_optimizer``: Megatron's distributed optimizer (float32 only)."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"adapter.dtype {dtype!r}: the built-in job trains in float32 or float64")
    if clip_grad is None:
        clip_grad = 1.0 if dtype == "float32" else 0.0
    params_dtype = getattr(torch, dtype)
    transformer = dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=num_heads,
                       ffn_hidden_size=ffn_hidden, hidden_dropout=0.0, attention_dropout=0.0,
                       params_dtype=params_dtype, pipeline_dtype=params_dtype)
    return MegatronJob(
        transformer=transformer, model_provider=partial(model_provider, vocab_size, seq_length),
        forward_step=forward_step, dataset=TokenDataset(vocab_size, seq_length), micro_batch_size=micro_batch_size,
        seq_length=seq_length, optimizer=dict(lr=lr, min_lr=lr / 10, weight_decay=0.01, clip_grad=clip_grad,
                                                 use_distributed_optimizer=distributed_optimizer),
        scheduler=dict(init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=2 * micro_batch_size * 4,
                       lr_decay_steps=100 * micro_batch_size * 4, lr_decay_style="cosine", start_wd=0.01,
                       end_wd=0.01, wd_incr_steps=1, wd_incr_style="constant"),
    )
