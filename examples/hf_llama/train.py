"""A Hugging Face training script: a tiny LlamaForCausalLM (random init from a config),
AdamW, a warm-up + cosine LR schedule, gradient clipping at 1.0 and a dataset over
local text. The same script runs under plain ``accelerate launch`` (stock torch:
pipeline stages with fully_shard; a dead rank ends the job) and, unchanged, under
``resihp launch`` (it keeps training through dead and slow ranks).

    accelerate launch --config_file accelerate.yaml train.py
    resihp launch     --config_file accelerate.yaml train.py

The pipeline depth, micro-batches per replica and iterations are in resihp.toml.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from hf_model import TextWindows, adamw, tiny_model, warmup_cosine
from resihp_adapters.torch_native import initialize

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(HERE / "resihp.toml"),
                    help="ResiHP configuration for a plain launch (resihp launch uses its own)")
    ap.add_argument("--text", default=str(HERE / "README.md"), help="local text to train on")
    ap.add_argument("--model", default="llama", choices=("llama", "qwen2"))
    ap.add_argument("--iterations", type=int, default=8, help="for the LR schedule (resihp.toml's)")
    ap.add_argument("--dump", default="", help="write each rank's complete final state here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    trainer = initialize(
        tiny_model(a.model),  # the user's model: state keeps its own parameter names
        optimizer=adamw,  # a factory of a parameter list (rebuilt per stage layout)
        lr_scheduler=warmup_cosine(a.iterations),  # a factory of the optimizer
        max_grad_norm=1.0,  # the global norm over every stage and FSDP shard
        dataset=TextWindows(a.text, seq_len=16), micro_batch_size=2,
        config=a.config)
    while (loss := trainer.train_batch()) is not None:  # None: the job ended
        shown = f" loss={loss!r}" if trainer.is_last_stage() else ""
        print(f"rank={os.environ.get('RANK')} pid={os.getpid()} iteration={trainer.iteration}{shown}", flush=True)
        if a.dump and trainer.iteration == a.iterations:  # every executor, at the same point
            state = trainer.full_state()
            if state:
                torch.save(state, Path(a.dump) / f"rank{os.environ.get('RANK')}.pt")


if __name__ == "__main__":
    main()
