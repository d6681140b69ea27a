"""The engine's per-iteration snapshot reuses its buffers (docs/benchmarks.md) and still
rolls back exactly: one process, world of 1 (gloo), float64."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_core.predictor.schedules import emit_programs  # noqa: E402
from resihp_adapters.torch_native.data import Batches, job_source  # noqa: E402
from resihp_adapters.torch_native.engine import TorchNativeEngine  # noqa: E402
from resihp_adapters.torch_native.model import LlamaConfig  # noqa: E402


def _state(eng: TorchNativeEngine) -> dict[str, tuple[torch.Tensor, ...]]:
    return {k: (h.param.clone(), *(h.sharded[x].clone() for x in sorted(h.sharded)),
                *(v.clone() for _, v in sorted(h.other.items())))
            for k, h in eng.local_shards().items()}


@pytest.mark.timeout(120)
def test_snapshot_buffers_are_reused_and_rollback_is_exact():
    cfg = LlamaConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, ffn_dim=16, dtype="float64")
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 16},
                  dp=1, num_microbatches=2)
    eng = TorchNativeEngine(0, cfg, Batches(job_source(job, 32), torch.float64), dist.HashStore(),
                            shard_degree=1, lr=0.01, weight_decay=0.0)
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=2)
    eng.rebuild(plan, 0, [0])
    try:
        eng.start_fresh()
        prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(0, 0)]
        for i in range(2):  # the optimizer's state exists from the first step on
            eng.snapshot()
            eng.run(prog, i)
        eng.snapshot()
        buffers = eng._snapshot[0]
        before = _state(eng)
        eng.run(prog, 2)
        eng.snapshot()  # the same buffers, now holding the state after iteration 2
        assert eng._snapshot[0] is buffers
        after = _state(eng)
        assert any(not torch.equal(a[0], b[0]) for a, b in zip(before.values(), after.values()))
        eng.run(prog, 3)
        eng.rollback()  # back to the state after iteration 2, exactly
        assert eng.iteration == 3
        got = _state(eng)
        assert got.keys() == after.keys()
        for k in after:
            assert all(torch.equal(x, y) for x, y in zip(got[k], after[k])), k
    finally:
        eng.release()
