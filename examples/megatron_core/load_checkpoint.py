"""Load a checkpoint ResiHP wrote with plain Megatron-Core, at TP1 x PP1 in one process,
whatever layout wrote it, and train the next iteration of the built-in job:

    .venv/bin/resihp run examples/megatron_core/resihp.toml --workdir /tmp/mc   # TP2 x PP2 x DP2
    .venv/bin/python examples/megatron_core/load_checkpoint.py /tmp/mc/checkpoints/iter00000011

It prints the checkpoint's positions and the next iteration's loss, which equals that
iteration's loss in the uninterrupted run (the stock command of resihp.toml with one
iteration more) up to float32 summation order. Only ``dist_checkpointing.load`` and the
model's ``sharded_state_dict()`` read the checkpoint; ResiHP only builds the same job."""

from __future__ import annotations

import argparse
import os
import socket

from megatron.core import dist_checkpointing

from resihp_adapters.megatron_core.spec import load_job
from resihp_adapters.megatron_core.stock import StockRun


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a checkpoint's iteration folder (.../checkpoints/iter<NNNNNNNN>)")
    ap.add_argument("--microbatches", type=int, default=4, help="the job's global batch in micro-batches "
                    "(resihp.toml: 2 per replica x DP 2)")
    args = ap.parse_args()
    with socket.socket() as s:  # a world of one process
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    run = StockRun(load_job({}), tp=1, pp=1, microbatches=args.microbatches, seed=1)  # other initial weights
    state = dist_checkpointing.load({"model": run.tr.model.sharded_state_dict()}, args.folder)
    run.tr.model.load_state_dict(state["model"])
    print("positions:", state["resihp"])
    run.iteration = state["resihp"]["data_iteration"]
    print(f"iteration {run.iteration} loss {run.train_batch():.9f}")
    run.close()


if __name__ == "__main__":
    main()
