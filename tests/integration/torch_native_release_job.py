"""One process of the release test. Both ranks train one iteration of pp2 x dp1; then
rank 0 aborts its next iteration after its first forward (as a survivor does when its
generation is superseded) and releases the generation, staying alive; rank 1 is left in
a receive from rank 0. Rank 1 reports how long that receive took to fail: gloo closes
rank 0's sockets only when nothing refers to the released groups any more.

Run as ``python torch_native_release_job.py DEVICE STORE_PORT OUT_DIR``.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from resihp_core.data import create_source
from resihp_core.plan import ParallelPlan
from resihp_core.predictor.schedules import emit_programs
from resihp_adapters.torch_native.data import Batches
from resihp_adapters.torch_native.engine import TorchNativeEngine, captured_groups
from resihp_adapters.torch_native.model import LlamaConfig

OP_TIMEOUT_S = 30.0


def main(device: int, port: int, out: Path) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=4, n_heads=2, ffn_dim=32)
    source = create_source({"source": "synthetic", "token_budget": 16}, dp=1, num_microbatches=4, vocab_size=64)
    eng = TorchNativeEngine(device, cfg, Batches(source), store, timeout_s=OP_TIMEOUT_S)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=4)
    eng.rebuild(plan, 0)
    eng.start_fresh()
    prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(eng.place.replica, eng.place.stage)]
    eng.run(prog)
    store.set(f"trained/{device}", "1")
    store.wait([f"trained/{d}" for d in range(2)])
    report: dict = {"captured": captured_groups()}
    if device == 0:
        calls = [0]

        def abort() -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("generation superseded")

        eng.before_action = abort
        eng.snapshot()
        failed = None
        try:
            eng.run(prog)
        except RuntimeError as e:
            failed = str(e)
        eng.rollback()
        t0 = time.monotonic()
        eng.release()
        report.update(aborted=failed, release_s=time.monotonic() - t0)
        (out / "0.json").write_text(json.dumps(report))
        store.wait(["done/1"], datetime.timedelta(seconds=120))  # alive until rank 1 is through
    else:
        eng.snapshot()
        t0 = time.monotonic()
        try:
            eng.run(prog)
            report["error"] = None
        except Exception as e:  # noqa: BLE001 - the receive from the released peer
            report["error"] = str(e)[:300]
        report["wait_s"] = time.monotonic() - t0
        (out / "1.json").write_text(json.dumps(report))
        # As the worker runtime after a failed iteration: back to the snapshot, then the
        # groups go now, not at interpreter shutdown (a live gloo group can abort the exit).
        eng.rollback()
        eng.release()
        store.set("done/1", "1")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
