"""A pretrain_gpt-shaped script of your own, run stock or resilient unchanged:

    # stock Megatron-Core, no ResiHP (PP2 x DP2, the layout of resihp_pp2.toml)
    python -m torch.distributed.run --nproc-per-node 4 pretrain_gpt.py --config resihp_pp2.toml
    # the same script under ResiHP: survives dead and slow devices
    resihp launch --resihp_config resihp_pp2.toml pretrain_gpt.py

The job is my_gpt.job(); initialize() hands it to ResiHP under ``resihp launch`` and to
plain Megatron-Core under torchrun. ``--losses DIR``: every rank appends its share of
each iteration's global mean loss to ``DIR/rank<R>.jsonl`` (the shares of an iteration
sum to its loss)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from my_gpt import job

from resihp_adapters.megatron_core import initialize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).with_name("resihp_pp2.toml")),
                    help="the ResiHP configuration (torchrun: the layout and length; resihp launch names its own)")
    ap.add_argument("--losses", default=None, help="folder for each rank's loss shares (JSON lines)")
    args = ap.parse_args()
    trainer = initialize(job(), config=args.config)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.losses) / f"rank{rank}.jsonl" if args.losses else None
    while (share := trainer.train_batch()) is not None:
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps({"iteration": trainer.iteration - 1, "loss": share}) + "\n")


if __name__ == "__main__":
    main()
