"""The Hugging Face example with your own training loop (data-parallel jobs, pp = 1):
forward, loss and backward are the script's; ResiHP hands each replica its micro-batches
of the iteration and one call reduces, clips, steps the optimizer and the LR schedule
and commits. Under ``resihp launch`` a dead or slow worker is survived (the iteration is
rolled back and run again under the next plan); under plain ``accelerate launch`` it is
stock FSDP2.

    resihp launch     --config_file accelerate.yaml --resihp_config resihp_dp.toml train_loop.py
    accelerate launch --config_file accelerate.yaml train_loop.py --config resihp_dp.toml
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
    ap.add_argument("--config", default=str(HERE / "resihp_dp.toml"),
                    help="ResiHP configuration for a plain launch (resihp launch uses its own)")
    ap.add_argument("--text", default=str(HERE / "README.md"), help="local text to train on")
    ap.add_argument("--iterations", type=int, default=8, help="for the LR schedule (resihp_dp.toml's)")
    ap.add_argument("--dump", default="", help="write each rank's complete final state here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    trainer = initialize(tiny_model("llama"), optimizer=adamw, lr_scheduler=warmup_cosine(a.iterations),
                         max_grad_norm=1.0, dataset=TextWindows(a.text, seq_len=16), micro_batch_size=2,
                         config=a.config)
    for it in trainer.iterations():  # one per iteration; reconfigures between them
        with it:  # a dead peer inside: rolled back, run again under the next plan
            for batch in it.microbatches():  # this replica's share of the global batch
                outputs = it.model(**batch)  # your model's own forward (FSDP2-wrapped)
                it.backward(outputs.loss)  # weighted so the step is the global batch's
            it.step()  # reduce, clip, AdamW, LR schedule, commit
        if not it.committed:
            continue  # a peer died: the iteration comes again under the next plan
        print(f"rank={os.environ.get('RANK')} pid={os.getpid()} iteration={it.index + 1} loss={it.loss!r}", flush=True)
        if a.dump and it.index + 1 == a.iterations:  # every worker, at the same point
            state = trainer.full_state()
            if state:
                torch.save(state, Path(a.dump) / f"rank{os.environ.get('RANK')}.pt")


if __name__ == "__main__":
    main()
