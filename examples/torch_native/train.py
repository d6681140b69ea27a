"""A torch-native training script (torch.distributed.pipelining stages sharded with
FSDP2) that runs under plain ``accelerate launch`` and, unchanged, under ``resihp
launch`` (which keeps it training through dead and slow ranks). The only ResiHP line is
the ``initialize`` call; the model, data and pipeline depth are in ``resihp.toml``.

    accelerate launch --config_file accelerate.yaml train.py
    resihp launch     --config_file accelerate.yaml train.py
"""

from __future__ import annotations

import argparse
import os

from resihp_adapters.torch_native import initialize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "resihp.toml"),
                    help="ResiHP configuration for a plain launch (resihp launch uses its own)")
    a = ap.parse_args()
    trainer = initialize(a.config)
    while (loss := trainer.train_batch()) is not None:  # None: the job ended
        # loss: this rank's share of the global loss (its replica's micro-batches, last stage)
        shown = f" loss={loss!r}" if trainer.is_last_stage() else ""
        print(f"rank={os.environ.get('RANK')} pid={os.getpid()} iteration={trainer.iteration}{shown}", flush=True)


if __name__ == "__main__":
    main()
