"""A user's job for the conformance kit (``adapter_config.user``): the tiny Hugging Face
LLaMA of ``examples/hf_llama`` (GQA, tied embeddings) with AdamW, warm-up + cosine
LambdaLR and clipping at 1.0 over local text."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def llama():  # noqa: ANN201 - returns resihp_adapters.torch_native.api.UserJob
    sys.path.insert(0, str(ROOT / "examples" / "hf_llama"))
    from hf_model import TextWindows, adamw, tiny_model, warmup_cosine

    from resihp_adapters.torch_native.api import user_job

    return user_job(tiny_model("llama"), optimizer=adamw, lr_scheduler=warmup_cosine(4), max_grad_norm=1.0,
                    dataset=TextWindows(ROOT / "docs" / "torch_native.md", 16), micro_batch_size=2)
