"""Communicators derived from the live world on gloo, and a survivor released by its
group's timeout when a peer goes silent mid-collective (regroup_job.py): three real
processes, a 2 s op timeout, about ten seconds in all."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.integration

from tests.integration.test_torch_native import run_devices  # noqa: E402

HERE = Path(__file__).parent
OP_TIMEOUT_S = 2.0  # regroup_job.OP_TIMEOUT_S


@pytest.mark.timeout(120)
def test_kept_world_and_a_silent_peer_released_by_the_timeout(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    run_devices(lambda d: [str(HERE / "regroup_job.py"), str(d), str(store.port), str(tmp_path)], 3, tmp_path, 100)
    reports = {d: json.loads((tmp_path / f"{d}.json").read_text()) for d in range(3)}
    for d, r in reports.items():
        assert r["g0"]["comm_path"] == "rebuild", (d, r)
        assert r["g1"]["comm_path"] == "keep", (d, r)  # same members, every one holding the world
        assert r["g1"]["world_s"] < r["g0"]["world_s"], (d, r)  # nothing to connect for the world
        assert r["g1_sum"] == 6.0, (d, r)  # 1 + 2 + 3 over the group made in the kept world
    for d in (0, 1):
        r = reports[d]
        assert r["blocked_error"] is not None, f"device {d} finished an all-reduce its silent peer never joined"
        # Released by the group's own timeout: not before it, and not much after.
        assert 0.5 * OP_TIMEOUT_S <= r["blocked_s"] <= OP_TIMEOUT_S + 4.0, (d, r)
        assert r["g2"]["comm_path"] == "rebuild", (d, r)
        # Device 1 had released its world: the vote fails for device 0, which still holds one.
        assert ("no live group" if d == 1 else "do not all hold") in r["g2_reason"], (d, r)
        assert r["g2_sum"] == 3.0, (d, r)
