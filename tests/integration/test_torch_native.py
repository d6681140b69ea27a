"""torch_native adapter: FSDP2 stages in torch's pipeline runtime, rebuilt live.

Every run is real: 4 worker processes, gloo, a TCP store hosted here, float64, and a
killed worker really exits mid-iteration. Parameters and AdamW moments are compared
with a single-process run over the same micro-batches (and, fault-free, with stock
torch pipelining + fully_shard).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from resihp_core.plan import ParallelPlan  # noqa: E402

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
MODEL = {"vocab_size": 64, "dim": 16, "n_layers": 4, "n_heads": 2, "ffn_dim": 32, "dtype": "float64"}
# The job's data: synthetic documents packed into 16-token micro-batches (several per pack).
DATA = {"source": "synthetic", "token_budget": 16, "scale": 3.0, "min_len": 2, "max_len": 16}
TOL = 1e-9


def run_devices(argv, n: int, logs: Path, timeout: float) -> None:
    """Start ``python *argv(d)`` for devices 0..n-1 (logs in ``logs/<d>.log``), wait for all,
    kill (by pid) what is left at the timeout; assert every one exited 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    try:
        for d in range(n):
            with open(logs / f"{d}.log", "w") as log:
                procs[d] = subprocess.Popen([sys.executable, *argv(d)], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        for p in procs.values():
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs.values():  # by pid, only what this test started
            if p.poll() is None:
                p.kill()
                p.wait()
    for d, p in procs.items():
        assert p.returncode == 0, f"device {d} failed:\n{(logs / f'{d}.log').read_text()[-3000:]}"


def run_fidelity_job(tmp: Path, plan: str, iterations: int, *, shard: int, plain: str,
                     timeout: float = 360.0) -> dict[int, dict]:
    """One process per device (torch_native_job.py), a store hosted here; reports by device."""
    spec = {"model": MODEL, "data": DATA, "shard": shard, "plan": plan, "iterations": iterations,
            "plain": plain, "out": str(tmp)}
    (tmp / "spec.json").write_text(json.dumps(spec))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    run_devices(lambda d: [str(HERE / "torch_native_job.py"), str(tmp / "spec.json"), str(d), str(store.port)],
                4, tmp, timeout)
    return {d: json.loads((tmp / f"{d}.json").read_text()) for d in range(4)}


def stages(tmp: Path, prefix: str = "stage") -> dict:
    full = {}
    for f in sorted(tmp.glob(f"{prefix}[0-9]*.pt")):
        full.update(torch.load(f))
    return full


def max_rel_err(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((x.detach() - y.detach()).abs().max() / y.abs().max().clamp_min(1e-300))
               for k in a for x, y in zip(a[k], b[k]))


def reference(iterations: int, dp: int = 2, m: int = 4, model: dict | None = None) -> tuple[dict, list[float]]:
    """One process over the job's global batch (dp x m micro-batches of DATA)."""
    from resihp_core.data import create_source
    from resihp_adapters.torch_native.data import Batches
    from resihp_adapters.torch_native.model import LlamaConfig
    from resihp_adapters.torch_native.reference import single_process_run

    cfg = LlamaConfig(**(model or MODEL))
    data = Batches(create_source(DATA, dp=dp, num_microbatches=m, seed=0, vocab_size=cfg.vocab_size), cfg.torch_dtype)
    return single_process_run(cfg, data, iterations)


def plan_text(**kw) -> str:
    return ParallelPlan.uniform(tp=1, num_layers=4, **kw).to_text()


@pytest.mark.timeout(420)
def test_fault_free_equals_stock_torch_pipelining_with_fully_shard(tmp_path):
    """pp2 x dp2, FSDP2 over each stage's 2 replicas, 1F1B from the core's programs:
    parameters, AdamW moments and losses equal stock torch's and a single process's."""
    plan = plan_text(pp=2, dp=2, num_microbatches=4)
    reports = run_fidelity_job(tmp_path, plan, 3, shard=0, plain="1f1b")
    ours, plain = stages(tmp_path), stages(tmp_path, "plain_stage")
    assert max_rel_err(ours, plain) <= TOL
    ref, ref_losses = reference(3)
    assert max_rel_err(ours, ref) <= TOL
    last = [r for r in reports.values() if r["stage"] == 1]
    for r in last:  # each last-stage rank: its replica's share of the global loss
        assert r["losses"] == pytest.approx(r["plain_losses"], rel=TOL)
    assert [sum(x) for x in zip(*(r["losses"] for r in last))] == pytest.approx(ref_losses, rel=TOL)


def three_stages(devices: tuple[int, int, int]) -> ParallelPlan:
    """The 3 survivors as one replica of 3 stages (layers 0 | 1 | 2-3), 8 micro-batches:
    the same global batch as pp2 x dp2 x 4 micro-batches."""
    return ParallelPlan(num_layers=4, layer_ranges=((0, 1), (1, 2), (2, 4)),
                        tp_groups=(tuple((d,) for d in devices),), num_microbatches=8, excluded=frozenset({1}))


def kill_and_repartition(tmp: Path, *, shard: int, restore: bool, checkpoint: bool = False) -> dict:
    """Through the core's worker runtime: pp2 x dp2, 4 micro-batches each; device 1
    (replica 1, stage 0) is SIGKILLed inside iteration 2; the survivors (same
    processes) run one pipeline of 3 stages to iteration 5, moving state from memory or
    restoring the last DCP checkpoint. ``checkpoint``: write one every iteration (and
    keep them all) even when moving from memory."""
    from resihp_core import checkpoints
    from resihp_core.job import JobSpec
    from resihp_core.runtime.controller.launcher import LocalJob
    from resihp_core.testing.conformance import _assemble

    job = JobSpec(adapter="torch_native", adapter_config={"model": MODEL, "shard": shard}, data=DATA,
                  dp=2, num_microbatches=4, seed=0, timeout_s=10.0, dump_dir=str(tmp / "dump"),
                  checkpoint_dir=str(tmp / "ckpt"), checkpoint_every=1 if restore or checkpoint else 0)
    (tmp / "dump").mkdir()
    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    with LocalJob(job.to_json(), base.devices(), workdir=tmp / "job") as lj:
        lj.post(base, iterations=5)
        lj.wait(2, timeout=300)
        pids = {d: int(lj.store.get(f"worker/{d}/pid")) for d in base.devices()}
        time.sleep(0.02)  # inside iteration 2
        lj.kill(1)
        lj.wait(5, timeout=300, on_death="return")
        resume = lj.abort()
        point = None
        if restore:
            # The supervisor's rule: the newest sealed checkpoint before ``resume`` (the
            # last one is written in the background and may not be sealed yet), and the
            # iterations after it trained again.
            point = checkpoints.restore_point(tmp / "ckpt", resume, 1)[0]
            resume = lj.committed = 0 if point is None else point + 1
        g = lj.post(three_stages((0, 2, 3)), iterations=5, resume=resume,
                    restore=(-1 if point is None else point) if restore else None)
        lj.wait(5, timeout=300)
        ready = {d: json.loads(lj.store.get(f"ctl{g}/ready/{d}")) for d in (0, 2, 3)}
        losses = [sum(r.loss for r in lj.report(i).values()) for i in range(5)]
        computed = [sorted(c for r in lj.report(i).values() for c in r.computed) for i in range(5)]
        # Survivors keep their processes: the pid each worker registered at start is the
        # launcher's child, still running after the reconfiguration.
        after = {d: int(lj.store.get(f"worker/{d}/pid")) for d in (0, 2, 3)}
        alive_pids = {d: lj.processes.procs[d].pid for d in lj.alive()}
        assert after == {d: pids[d] for d in (0, 2, 3)} == alive_pids
        lj.close()
    dumps = {int(f.stem[len("device"):]): torch.load(f, weights_only=False) for f in (tmp / "dump").glob("device*.pt")}
    return {"pids": pids, "alive_pids": alive_pids, "resume": resume, "ready": ready, "losses": losses,
            "computed": computed, "state": _assemble(dumps), "dumps": dumps}


def as_triples(state: dict) -> dict:
    return {k: tuple(v) for k, v in state.items()}


def load_whole(path: Path, step: int):
    """A one-process engine (pp1 x dp1, world of 1) built from DCP checkpoint ``path``."""
    from resihp_core.job import JobSpec
    from resihp_adapters.torch_native.data import Batches, job_source
    from resihp_adapters.torch_native.engine import TorchNativeEngine
    from resihp_adapters.torch_native.model import LlamaConfig

    cfg = LlamaConfig(**MODEL)
    job = JobSpec(adapter="torch_native", adapter_config={}, data=DATA, dp=1, num_microbatches=8)
    eng = TorchNativeEngine(0, cfg, Batches(job_source(job, cfg.vocab_size), cfg.torch_dtype), dist.HashStore(),
                            shard_degree=1)
    eng.rebuild(ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=4, num_microbatches=8), 0, [0])
    eng.load_checkpoint(str(path), step)
    return eng


@pytest.mark.timeout(420)
def test_killed_rank_under_hsdp_survivors_repartition_from_memory(tmp_path):
    """HSDP (each replica a whole copy): the survivors keep their processes and take
    every parameter and AdamW moment from the surviving copies. The checkpoints the
    HSDP layout wrote (one every iteration) come from one copy of each stage only
    (replicate index 0: 2 writers, not 4) and hold the complete state: read back into
    one process, they equal the single-process run, step counts included."""
    out = kill_and_repartition(tmp_path, shard=1, restore=False, checkpoint=True)
    from resihp_core.checkpoints import iteration_dir

    dcp_dir = iteration_dir(tmp_path / "ckpt", 1) / "dcp"
    # one file per writer, named by the generation and the writer's rank
    assert sorted(p.name for p in dcp_dir.glob("*.distcp")) == ["__g0r0_0.distcp", "__g0r1_0.distcp"]
    eng = load_whole(dcp_dir, 2)
    try:
        ref2, _ = reference(2)
        held = eng.local_shards()
        assert max_rel_err({k: h.tensors() for k, h in held.items()}, ref2) <= TOL
        assert all(int(h.other["step"]) == 2 for h in held.values())
    finally:
        eng.release()
    assert sorted(out["dumps"]) == [0, 2, 3] and all(d["iteration"] == 5 for d in out["dumps"].values())
    # Device 2 (old stage 1) now runs layer 1: it receives it from device 0's copy;
    # devices 0 and 3 already hold whole copies of what they keep.
    assert out["ready"][2]["bytes_received"] > 0
    assert out["ready"][0]["bytes_received"] == 0 == out["ready"][3]["bytes_received"]
    ref, ref_losses = reference(5)
    assert max_rel_err(as_triples(out["state"]), ref) <= TOL
    assert out["losses"] == pytest.approx(ref_losses, rel=TOL)
    for it, c in enumerate(out["computed"]):  # every (stage, owner, mb) once, 8 per stage
        stages_run = {x[0] for x in c}
        assert stages_run == ({0, 1} if it < out["resume"] else {0, 1, 2}), (it, stages_run)
        assert len(c) == len(set(c)) and all(sum(1 for x in c if x[0] == s) == 8 for s in stages_run), it


@pytest.mark.timeout(300)
def test_killed_rank_with_the_step_after_the_commit_survivors_repartition_exact(tmp_path, monkeypatch):
    """Without SDC fingerprints a PP2 x DP2 job steps after the commit and takes no
    rollback snapshot (docs/worker-protocol.md, "The step after the commit"). A survivor
    whose pipeline receive fails mid-iteration has FSDP's unsharded parameters in
    place: it puts back the sharded ones, which the forward and backward never write,
    drops the gradients, and the three survivors train on from memory, exact."""
    monkeypatch.setenv("RESIHP_SDC", "0")
    out = kill_and_repartition(tmp_path, shard=1, restore=False)
    logs = [p.read_text() for p in (tmp_path / "job").rglob("*.log")]
    ready = [m for text in logs for m in re.findall(r"event=generation_ready .*?step_after_commit=(\d)", text)]
    assert len(ready) >= 7 and set(ready) == {"1"}, ready  # 4 workers in generation 0, 3 in 1
    ref, ref_losses = reference(5)
    assert max_rel_err(as_triples(out["state"]), ref) <= TOL
    assert out["losses"] == pytest.approx(ref_losses, rel=TOL)


@pytest.mark.timeout(420)
def test_killed_rank_under_fsdp2_restores_lost_shard_from_dcp(tmp_path):
    """FSDP2 (each replica half of each stage): half of stage 0 dies with device 1, so
    the survivors restore the last DCP checkpoint, written by the pp2 x dp2 layout, onto
    3 stages of one replica."""
    out = kill_and_repartition(tmp_path, shard=0, restore=True)
    assert all(d["iteration"] == 5 for d in out["dumps"].values())
    ref, ref_losses = reference(5)
    assert max_rel_err(as_triples(out["state"]), ref) <= TOL
    assert out["losses"] == pytest.approx(ref_losses, rel=TOL)
