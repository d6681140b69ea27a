"""One rank (device) of the multi-generation scenario: the runner enters each plan of
``_scenario.generations()`` in the same process and trains; dumps state and losses."""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    import _model as M
    import _scenario as S
    import torch.distributed as tdist

    from resihp_adapters.deepspeed.runner import PipelineRunner

    device = int(os.environ["RANK"])
    host, port = a.store.rsplit(":", 1)
    store = tdist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    runner = PipelineRunner(M.layer_specs(S.LAYERS), device=device, store=store, config=M.config(S.MBS, S.MB, S.DP),
                            dataset=M.Samples(), loss_fn=M.mse, optimizer=lambda ps: torch.optim.AdamW(ps, lr=S.LR),
                            nominal_replicas=S.DP, timeout_s=20, base_seed=S.SEED)
    import gc

    gc.freeze()  # as the real worker does: generation teardowns collect only new objects
    prev, it, log = None, 0, []
    for plan, iters in S.generations():
        active = runner.enter(plan, previous=prev, iteration=it)
        log.append({"generation": plan.generation, "active": active, "pid": os.getpid(), "rebuild": runner.last_rebuild_s})
        for _ in range(iters):
            if active:
                loss = runner.train_iteration()
                log[-1].setdefault("losses", []).append(loss)
            it += 1
        prev = plan
    state = {f"{i}.{k}": v for i, st in runner.layer_state().items() for k, v in st.get("params", {}).items()}
    torch.save({"log": log, "params": state, "iteration": runner.iteration}, os.path.join(a.out, f"dev{device}.pt"))
    runner.close()


if __name__ == "__main__":
    main()
