"""torch_native checkpoints written off the training path (.async_checkpoint): a
checkpoint written in the background reads back as the exact state, and a writer
killed mid-write leaves a folder without a manifest that the restore rule skips.
Float64, gloo, CPU."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from resihp_core import checkpoints  # noqa: E402
from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_core.predictor.schedules import emit_programs  # noqa: E402
from resihp_adapters.torch_native.async_checkpoint import AsyncDcpWriter  # noqa: E402
from resihp_adapters.torch_native.data import Batches, job_source  # noqa: E402
from resihp_adapters.torch_native.engine import TorchNativeEngine  # noqa: E402
from resihp_adapters.torch_native.model import LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, ffn_dim=16, dtype="float64")


def _engine(device: int, dp: int, store: object) -> tuple[TorchNativeEngine, object]:
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 16},
                  dp=dp, num_microbatches=2)
    eng = TorchNativeEngine(device, CFG, Batches(job_source(job, 32), torch.float64), store, shard_degree=0,
                            lr=0.01, timeout_s=60, join_timeout_s=300)
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=dp, num_layers=2, num_microbatches=2)
    eng.rebuild(plan, 0, list(range(dp)))
    return eng, {(p.replica, p.stage): p for p in emit_programs(plan)}[(eng.place.replica, 0)]


def _write(eng: TorchNativeEngine, writer: AsyncDcpWriter, root: Path, iteration: int, keep: int = 0) -> None:
    assert writer.wait_idle(120)
    state, plan = eng.stage_checkpoint()
    writer.submit(iteration, str(root), str(checkpoints.iteration_dir(root, iteration) / "dcp"), state, plan,
                  keep, 0.0)


@pytest.mark.timeout(300)
def test_background_checkpoint_is_sealed_and_restores_exactly(tmp_path):
    """Submitting returns before any file is written (training goes on), and the state
    is copied at submit: a step taken before the write does not leak into it. A seal
    that lands after the rank moved to another generation applies no retention."""
    old = checkpoints.iteration_dir(tmp_path, 0)
    old.mkdir()
    (old / "x.bin").write_bytes(b"an older complete checkpoint")
    checkpoints.seal(tmp_path, 0)
    eng, prog = _engine(0, 1, dist.HashStore())
    generation = [7]  # the rank's generation: not the one the writes were planned in
    writer = AsyncDcpWriter(generation=lambda: generation[0])
    try:
        eng.start_fresh()
        for i in range(2):
            eng.run(prog, i)
        want = eng.flat_state()
        release = threading.Event()
        writer.before_write = lambda it: release.wait(120)  # the file write waits for the test
        _write(eng, writer, tmp_path, 1, keep=1)
        eng.run(prog, 2)  # the next step runs while the write has not even started
        assert not checkpoints.verify(tmp_path, 1).complete
        release.set()
        assert writer.drain(120)
        done = writer.results()
        assert checkpoints.verify(tmp_path, 0).complete  # a late seal: retention left alone
        generation[0] = eng.generation
        _write(eng, writer, tmp_path, 2, keep=2)
        assert writer.drain(120)
        done += writer.results()
    finally:
        eng.release()
    assert [(w.iteration, w.error, w.pruned) for w in done] == [(1, None, ()), (2, None, (0,))]
    assert done[0].bytes > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter00000001", "iter00000002"]
    assert not list((tmp_path / "iter00000001" / "dcp").glob("written-*"))  # the results files are gone
    eng, _ = _engine(0, 1, dist.HashStore())
    try:
        eng.load_checkpoint(str(tmp_path / "iter00000001" / "dcp"), 2)
        got = eng.flat_state()
    finally:
        eng.release()
    assert got.keys() == want.keys()
    bad = [k for k, v in want.items() if not (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v)]
    assert bad == []


def _rank(device: int, port: int, root: str, marker: str) -> None:
    """One rank of the kill test (run as a process): checkpoint 0 sealed, then
    checkpoint 1 with device 1's writer paused until the test kills it."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    eng, prog = _engine(device, 2, store)
    writer = AsyncDcpWriter(seal_timeout_s=3.0)
    eng.start_fresh()
    eng.run(prog, 0)
    _write(eng, writer, Path(root), 0)
    assert writer.drain(240)
    dist.barrier()
    eng.run(prog, 1)
    if device == 1:
        def pause(iteration: int) -> None:
            Path(marker).touch()
            time.sleep(600)
        writer.before_write = pause
    _write(eng, writer, Path(root), 1)
    writer.drain(240)
    with open(os.path.join(root, f"results{device}.json"), "w") as f:
        json.dump([[w.iteration, w.error] for w in writer.results()], f)
    os._exit(0)  # the peer is gone: no group teardown


@pytest.mark.timeout(600)
def test_writer_killed_mid_write_leaves_an_unsealed_checkpoint_the_restore_rule_skips(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "paused"
    root.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(d), str(store.port), str(root), str(marker)],
                              env=env) for d in range(2)]
    try:
        deadline = time.monotonic() + 400
        while not marker.exists():
            assert time.monotonic() < deadline, "device 1 never started writing checkpoint 1"
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        assert procs[0].wait(timeout=300) == 0
    finally:
        for p in procs:  # only the processes this test started
            if p.poll() is None:
                p.kill()
                p.wait()
    # Device 0 wrote its part of checkpoint 1; the coordinator never saw device 1 finish.
    assert list((root / "iter00000001" / "dcp").glob("__g0r0_*.distcp"))
    assert not (root / "iter00000001" / checkpoints.MANIFEST).exists()
    assert json.loads((root / "results0.json").read_text()) == [[0, None]]  # no storage fault for 1
    it, skipped = checkpoints.restore_point(root, 2, 1, grace_s=0.2)
    assert it == 0
    assert [s.iteration for s in skipped] == [1] and "manifest.json is missing" in skipped[0].problem


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
