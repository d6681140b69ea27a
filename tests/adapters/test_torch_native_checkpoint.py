"""The engine's DCP checkpoints pack each parameter's optimizer hyper-parameters into one
entry (docs/torch_native.md, "State across generations") and still restore the complete
state exactly; a checkpoint in the earlier layout (one entry per value) still loads.
One process, world of 1 (gloo), float64."""

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

CFG = LlamaConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, ffn_dim=16, dtype="float64")
PLAN = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=2)


def _engine() -> TorchNativeEngine:
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 16},
                  dp=1, num_microbatches=2)
    eng = TorchNativeEngine(0, CFG, Batches(job_source(job, 32), torch.float64), dist.HashStore(),
                            shard_degree=1, lr=0.01)
    eng.rebuild(PLAN, 0, [0])
    return eng


def _same(got: dict, want: dict) -> list[str]:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return [k for k, v in want.items()
            if not (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v)]


@pytest.mark.timeout(120)
def test_packed_hyper_parameters_restore_exactly_and_old_checkpoints_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    eng = _engine()
    try:
        eng.start_fresh()
        prog = {(p.replica, p.stage): p for p in emit_programs(PLAN)}[(0, 0)]
        for i in range(3):
            eng.run(prog, i)
        for g in eng.optimizer.param_groups:
            g["lr"] = 0.00123  # a value only the checkpoint holds (no scheduler rebuilds it)
        want = eng.flat_state()
        eng.save_checkpoint(str(tmp_path / "packed"))
        dcp.save(eng._state_dicts(), checkpoint_id=str(tmp_path / "flat"))  # the layout before packing
        params = len(list(eng.module.parameters()))
    finally:
        eng.release()
    entries = {w: dcp.FileSystemReader(str(tmp_path / w)).read_metadata().state_dict_metadata
               for w in ("packed", "flat")}
    groups = {w: [k for k in e if k.startswith("optim.param_groups.")] for w, e in entries.items()}
    assert len(groups["packed"]) == params  # one entry per parameter
    assert len(groups["flat"]) > 5 * params  # one per parameter and hyper-parameter
    for which in ("packed", "flat"):
        eng = _engine()
        try:
            eng.load_checkpoint(str(tmp_path / which), 3)
            assert _same(eng.flat_state(), want) == [], which  # parameters, moments, steps, lr, betas
        finally:
            eng.release()
