"""A torch_native generation that is released (not killed) closes its sockets at once.

A survivor whose generation is superseded stops and releases its groups; a peer still
blocked in a receive from it must fail fast, not wait out the op timeout (that wait made
kill -> first committed iteration 10-13 s). Two real processes over gloo: rank 0 releases
mid-iteration, rank 1's pending receive must fail well inside the 30 s op timeout.
"""

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


@pytest.mark.timeout(240)
def test_released_generation_closes_its_sockets(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    run_devices(lambda d: [str(HERE / "torch_native_release_job.py"), str(d), str(store.port), str(tmp_path)],
                2, tmp_path, 200)
    r0, r1 = (json.loads((tmp_path / f"{d}.json").read_text()) for d in range(2))
    assert r0["aborted"] == "generation superseded"
    assert r0["captured"] == [] == r1["captured"], "torch functions hold a process group as a default argument"
    assert r1["error"] is not None, "rank 1 finished an iteration its peer never ran"
    assert "timed out" not in r1["error"].lower(), r1["error"]
    # Rank 1 waited for rank 0's abort and release, then saw its sockets close: far less
    # than the 30 s op timeout it would otherwise have waited.
    assert r1["wait_s"] < 10.0, r1
