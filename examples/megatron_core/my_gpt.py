"""A port of a pretrain_gpt-style script to the megatron_core adapter: the job function
``[adapter] user = "my_gpt:job"`` names (run with this folder on PYTHONPATH). It builds
the same pieces pretrain_gpt builds from ``args``: a TransformerConfig, a model provider,
a forward step with its loss function, a dataset, the optimizer and scheduler settings."""

from __future__ import annotations

from functools import partial

from resihp_adapters.megatron_core.gpt import TokenDataset, forward_step, model_provider
from resihp_adapters.megatron_core.spec import MegatronJob

VOCAB, SEQ, MBS = 64, 16, 2


def job() -> MegatronJob:
    return MegatronJob(
        transformer=dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                         hidden_dropout=0.0, attention_dropout=0.0),
        model_provider=partial(model_provider, VOCAB, SEQ),
        forward_step=forward_step,
        dataset=TokenDataset(VOCAB, SEQ),
        micro_batch_size=MBS,
        seq_length=SEQ,
        optimizer=dict(lr=1e-3, min_lr=1e-4, weight_decay=0.01, clip_grad=1.0),
        scheduler=dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=16, lr_decay_steps=800,
                       lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=1,
                       wd_incr_style="constant"),
    )
