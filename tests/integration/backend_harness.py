"""Shared harness for multi-process runs of the reference backend: a tiny float64 model,
a job, the fault-free single-process reference, and the checks every scenario makes."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import dataclass

import torch

from resihp_core.plan import ParallelPlan
from resihp_core.runtime.controller.launcher import LocalJob
from resihp_core.job import JobSpec
from resihp_adapters.megatron_ref.adapter import data_spec, model_config
from resihp_adapters.megatron_ref.model import shard_dim
from resihp_adapters.megatron_ref.reference import reference_run

LAYERS = 4
HEADS = 4


def job_spec(dp: int, m: int, dump_dir: str, **kw) -> JobSpec:
    return JobSpec(
        adapter="megatron_ref",
        adapter_config=dict(vocab_size=64, hidden=32, num_heads=HEADS, ffn_hidden=64, num_layers=LAYERS,
                            dtype="float64"),
        data=dict(source="synthetic", scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64),
        dp=dp, num_microbatches=m, timeout_s=10.0, dump_dir=dump_dir, **kw,
    )


def uniform(tp: int, pp: int, dp: int, m: int, schedule: str = "1f1b") -> ParallelPlan:
    return ParallelPlan.uniform(tp=tp, pp=pp, dp=dp, num_layers=LAYERS, num_microbatches=m,
                                schedule=schedule, num_heads=HEADS)


@dataclass
class Finished:
    job: JobSpec
    dumps: dict[int, dict]
    losses: list[float]
    computed: list[Counter]


def finish(job: LocalJob, spec: JobSpec, iterations: int) -> Finished:
    """Collect per-iteration losses and accounting, stop the workers, read their dumps."""
    losses, computed = [], []
    for i in range(iterations):
        rep = job.report(i)
        losses.append(sum(r.loss for r in rep.values()))
        computed.append(Counter(tuple(x) for r in rep.values() for x in r.computed))
    job.close()
    return Finished(spec, read_dumps(spec), losses, computed)


def read_dumps(spec: JobSpec) -> dict[int, dict]:
    """Device -> the state its worker dumped when the job stopped."""
    return {int(f[len("device"):-3]): torch.load(os.path.join(spec.dump_dir, f), weights_only=False)
            for f in os.listdir(spec.dump_dir)}


def check_against_reference(done: Finished, iterations: int, tol: float = 1e-9) -> float:
    """Every live worker's shards (parameters and AdamW state) equal the fault-free
    single-process run's; every (stage, micro-batch) ran exactly once per iteration;
    losses match. Returns the worst relative error."""
    from resihp_core.plan import parse_plan

    # The reference runs in this process: one intra-op thread, like the workers. With
    # torch's default (2 here) its OpenMP threads spin against the workers and other
    # jobs: 13 reference iterations took 37 s instead of 3 s on a loaded 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, ref_losses = reference_run(model_config(done.job), data_spec(done.job), iterations)
    finally:
        torch.set_num_threads(threads)
    worst = 0.0
    assert done.dumps, "no worker dumped its state"
    for dev, st in done.dumps.items():
        assert st["iteration"] == iterations, f"device {dev} stopped at iteration {st['iteration']}"
        plan = parse_plan(st["plan"])
        r, s, t = st["where"]
        k = plan.degree(r, s)
        for name, shard in st["state"].items():
            d = shard_dim(name)
            assert (shard.dim, shard.parts) == ((d, k) if d is not None else (None, 1)), name
            for got, full in zip(shard.tensors, ref[name]):
                exp = full if d is None else full.chunk(k, d)[t]
                err = ((got - exp).abs().max() / exp.abs().max().clamp_min(1e-30)).item()
                worst = max(worst, err)
                assert err <= tol, f"device {dev} {name}: relative error {err:.3g}"
    dp, m, pp = done.job.dp, done.job.num_microbatches, None
    for i, c in enumerate(done.computed):
        stages = sorted({s for s, _, _ in c})
        pp = len(stages)
        want = Counter((s, o, j) for s in range(pp) for o in range(dp) for j in range(m))
        assert c == want, f"iteration {i}: micro-batch accounting differs: {c - want} extra, {want - c} missing"
    for i, (a, b) in enumerate(zip(done.losses, ref_losses)):
        assert abs(a - b) <= 1e-9 * abs(b), f"iteration {i}: loss {a} != reference {b}"
    return worst


#: Folders :func:`tmpdir` made during the running test (tests/conftest.py removes them
#: after a test that passed and keeps them, for its logs, after one that failed).
MADE: list[str] = []


def tmpdir() -> str:
    """A fresh folder under the system's temporary folder (short paths: unix sockets
    live in some), removed after the test if it passes."""
    path = tempfile.mkdtemp(prefix="resihp-test-")
    MADE.append(path)
    return path
