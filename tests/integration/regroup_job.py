"""One process of the regroup test (test_regroup.py): three devices, DP3 of one stage.

* generation 0: no live group, so the world is rebuilt;
* generation 1, same members: the world is kept (capabilities passed: gloo as probed
  always rebuilds) and the DP group made anew under
  generation 1's rendezvous (the job store's generation fence ends any wait still under
  generation 0's); an all-reduce over it sums every member's value;
* device 2 then goes silent (alive, sockets open: a hung host), and devices 0 and 1
  enter an all-reduce with it: each must be released by the group's timeout;
* generation 2 over devices 0 and 1: device 0 offers its live world, device 1 released
  its own, so the vote fails and both rebuild; the new group works.

Run as ``python regroup_job.py DEVICE STORE_PORT OUT_DIR``.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from resihp_core.plan import ParallelPlan
from resihp_core.runtime.session import generation_fenced
from resihp_adapters.torchkit import comm
from resihp_adapters.torchkit.regroup import Capabilities

OP_TIMEOUT_S = 2.0
# gloo as probed rebuilds every generation (no release of a blocked peer): this reaches
# the kept world's mechanics, which NCCL's split path shares.
KEEPING = Capabilities("gloo", releases_blocked=True)


def _sum(comms: comm.Communicators, value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, group=comms.dp_chunks[0][0][1])
    return float(t.item())


def main(device: int, port: int, out: Path) -> None:
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    latest = [0]
    store = generation_fenced(raw, lambda: latest[0], patience_s=60.0)
    report: dict = {}
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=3, num_layers=1, num_microbatches=3)
    c0 = comm.build_communicators(store, 0, [0, 1, 2], device, plan, OP_TIMEOUT_S)
    report["g0"] = c0.report()
    latest[0] = 1
    c1 = comm.build_communicators(store, 1, [0, 1, 2], device, plan, OP_TIMEOUT_S, previous=c0, caps=KEEPING)
    del c0
    report["g1"] = c1.report()
    report["g1_sum"] = _sum(c1, device + 1.0)
    raw.set(f"summed/{device}", "1")
    raw.wait([f"summed/{d}" for d in range(3)])
    if device == 2:  # silent: a host that stopped answering, its sockets still open
        raw.wait(["released/0", "released/1"], datetime.timedelta(seconds=60))
        c1 = None
        comm.release()
        (out / "2.json").write_text(json.dumps(report))
        return
    t0 = time.monotonic()
    try:
        _sum(c1, 1.0)
        report["blocked_error"] = None
    except Exception as e:  # noqa: BLE001 - the timeout that releases this survivor
        report["blocked_error"] = str(e)[:200]
    report["blocked_s"] = time.monotonic() - t0
    raw.set(f"released/{device}", "1")
    latest[0] = 2
    plan2 = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=1, num_microbatches=2, devices=[0, 1])
    # Device 1 released its groups after the failure (as the worker does); device 0 offers its own.
    if device == 1:
        comm.release()
        c1 = None
    c2 = comm.build_communicators(store, 2, [0, 1], device, plan2, OP_TIMEOUT_S, previous=c1, caps=KEEPING)
    c1 = None
    report["g2"] = c2.report()
    report["g2_reason"] = c2.choice.reason
    report["g2_sum"] = _sum(c2, device + 1.0)
    comm.release()
    (out / f"{device}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
