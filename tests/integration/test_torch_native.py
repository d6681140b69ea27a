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
DATA = {"vocab_size": 64, "seq_len": 8, "batch": 2}
TOL = 1e-9


def run_job(tmp: Path, phases: list[dict], devices: list[int], *, shard: int, kill: dict | None = None,
            checkpoint_every: int = 0, plain: str | None = None, timeout: float = 100.0) -> dict[int, dict]:
    """Start one process per device, wait for the survivors, return their reports."""
    spec = {"model": MODEL, "data": DATA, "shard": shard, "phases": phases, "out": str(tmp),
            "kill": kill, "checkpoint_every": checkpoint_every, "plain": plain, "timeout_s": 5.0}
    (tmp / "spec.json").write_text(json.dumps(spec))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    procs = {}
    try:
        for d in devices:
            log = open(tmp / f"{d}.log", "w")
            procs[d] = subprocess.Popen(
                [sys.executable, str(HERE / "torch_native_job.py"), str(tmp / "spec.json"), str(d),
                 str(store.port)], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        for d, p in procs.items():
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = {}
    for d, p in procs.items():
        if kill and d == kill["device"]:
            assert p.returncode == 9, f"device {d} should have been killed"
            continue
        assert p.returncode == 0, f"device {d} failed:\n{(tmp / f'{d}.log').read_text()[-3000:]}"
        reports[d] = json.loads((tmp / f"{d}.json").read_text())
    return reports


def stages(tmp: Path, prefix: str = "stage") -> dict:
    full = {}
    for f in sorted(tmp.glob(f"{prefix}[0-9]*.pt")):
        full.update(torch.load(f))
    return full


def max_rel_err(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((x.detach() - y.detach()).abs().max() / y.abs().max().clamp_min(1e-300))
               for k in a for x, y in zip(a[k], b[k]))


def reference(microbatches: list[int]) -> tuple[dict, list[float]]:
    from resihp_adapters.torch_native.data import DataSpec
    from resihp_adapters.torch_native.model import LlamaConfig
    from resihp_adapters.torch_native.reference import single_process_run

    return single_process_run(LlamaConfig(**MODEL), DataSpec(**DATA), microbatches)


def plan_text(**kw) -> str:
    return ParallelPlan.uniform(tp=1, num_layers=4, **kw).to_text()


@pytest.mark.timeout(150)
def test_fault_free_equals_stock_torch_pipelining_with_fully_shard(tmp_path):
    """pp2 x dp2, FSDP2 over each stage's 2 replicas, 1F1B from the core's programs."""
    plan = plan_text(pp=2, dp=2, num_microbatches=4)
    reports = run_job(tmp_path, [{"plan": plan, "until": 3}], [0, 1, 2, 3], shard=0, plain="1f1b")
    ours, plain = stages(tmp_path), stages(tmp_path, "plain_stage")
    assert max_rel_err(ours, plain) <= TOL
    ref, ref_losses = reference([8, 8, 8])
    assert max_rel_err(ours, ref) <= TOL
    # Losses: each last-stage rank reports its replica's share; the plain run the same.
    for rep in reports.values():
        for key, loss in rep["losses"].items():
            it = int(key.split("/")[0])
            assert loss == pytest.approx(rep["plain_losses"][it], rel=TOL)
    assert summed_losses(reports, 3) == pytest.approx(ref_losses, rel=TOL)


def summed_losses(reports: dict, n: int) -> list[float]:
    """The global loss of each iteration: the sum of the replicas' shares, from the
    last generation that ran it (a replayed iteration counts once)."""
    every = {tuple(map(int, k.split("/"))): v for r in reports.values() for k, v in r["losses"].items()}
    last = {i: max(g for (j, g, _) in every if j == i) for i in range(n)}
    return [sum(v for (j, g, _), v in every.items() if j == i and g == last[i]) for i in range(n)]


def three_stages(devices: tuple[int, int, int]) -> str:
    """The 3 survivors as one replica of 3 stages (layers 0 | 1 | 2-3), 8 micro-batches:
    the same global batch as pp2 x dp2 x 4 micro-batches."""
    return ParallelPlan(num_layers=4, layer_ranges=((0, 1), (1, 2), (2, 4)),
                        tp_groups=(tuple((d,) for d in devices),), num_microbatches=8,
                        generation=1).to_text()


@pytest.mark.timeout(150)
def test_killed_rank_under_hsdp_survivors_repartition_from_memory(tmp_path):
    """HSDP (each replica a full copy): device 1 (replica 1, stage 0) dies in iteration 2;
    the 3 survivors, same processes, become one pipeline of 3 stages and take every
    parameter and AdamW moment from the surviving copies; no checkpoint exists."""
    phases = [{"plan": plan_text(pp=2, dp=2, num_microbatches=4), "until": 4},
              {"plan": three_stages((0, 2, 3)), "until": 4}]
    kill = {"device": 1, "iteration": 2, "chunk": 3}
    reports = run_job(tmp_path, phases, [0, 1, 2, 3], shard=1, kill=kill)
    assert sorted(reports) == [0, 2, 3]
    for d, rep in reports.items():
        gens = rep["generations"]
        assert [g["generation"] for g in gens] == [0, 1]
        assert "error" in gens[0], f"device {d} did not see the failure"
        assert gens[1]["how"].startswith("moved") and gens[1]["iteration"] == 2
        assert rep["iteration"] == 4
    assert len({r["pid"] for r in reports.values()}) == 3
    ref, ref_losses = reference([8] * 4)
    assert max_rel_err(stages(tmp_path), ref) <= TOL
    assert summed_losses(reports, 4) == pytest.approx(ref_losses, rel=TOL)


@pytest.mark.timeout(150)
def test_killed_rank_under_fsdp2_restores_lost_shard_from_dcp(tmp_path):
    """FSDP2 (each replica half of each stage): device 1 dies in iteration 3, so half of
    stage 0 has no surviving copy; the survivors restore the step-2 DCP checkpoint
    (written by the pp2 x dp2 layout) onto 3 stages and replay iterations 2 and 3."""
    phases = [{"plan": plan_text(pp=2, dp=2, num_microbatches=4), "until": 5},
              {"plan": three_stages((0, 2, 3)), "until": 5}]
    kill = {"device": 1, "iteration": 3, "chunk": 2}
    reports = run_job(tmp_path, phases, [0, 1, 2, 3], shard=0, kill=kill, checkpoint_every=2)
    for d, rep in reports.items():
        assert rep["generations"][1]["how"].startswith("restored step 2"), rep["generations"]
        assert rep["iteration"] == 5
    ref, ref_losses = reference([8] * 5)
    assert max_rel_err(stages(tmp_path), ref) <= TOL
    assert summed_losses(reports, 5) == pytest.approx(ref_losses, rel=TOL)
