"""A checkpoint the adapter writes is a Megatron-Core ``dist_checkpointing`` checkpoint: a
user's own model (other initial weights) loads it with ``dist_checkpointing.load`` and
its ``sharded_state_dict()`` exactly as Megatron-LM does, and Adam's moments under
Megatron's optimizer-state keys. One process (a world of 1, gloo); the layout changes
across a restore are proven by the conformance kit's ``restore`` scenario
(tests/conformance/test_megatron_core.py), which loads these checkpoints."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from resihp_core import checkpoints  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_a_user_loads_the_adapters_checkpoint_with_dist_checkpointing(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from resihp_adapters.megatron_core import checkpoint as mc
    from resihp_adapters.megatron_core.build import build_training
    from resihp_adapters.megatron_core.spec import load_job
    from resihp_adapters.megatron_core.stock import StockRun

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    job = load_job({"dtype": "float64", "num_layers": 2})
    run = StockRun(job, tp=1, pp=1, microbatches=2, seed=3)
    try:
        for _ in range(2):
            run.train_batch()
        tr = run.tr
        adam = {id(p): (s["exp_avg"], s["exp_avg_sq"])
                for o in [c.optimizer for c in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])]
                for p, s in o.state.items()}
        folder = checkpoints.iteration_dir(tmp_path, 1)
        folder.mkdir(parents=True)
        mc.save(folder, tr.model, adam, {"resihp": {"iteration": 1, "optimizer_step": 2}})

        # The user's side: a fresh model of the same job, other initial weights.
        other = build_training(job, tr.config, seed=4, device=None)
        assert not all(torch.equal(a, b) for a, b in zip(tr.model.parameters(), other.model.parameters()))
        model_sd = other.model.sharded_state_dict()
        loaded = dist_checkpointing.load({"model": model_sd}, str(folder))
        other.model.load_state_dict(loaded["model"])
        for (name, a), b in zip(tr.model.named_parameters(), other.model.parameters()):
            assert torch.equal(a, b), name
        # Adam's moments, by Megatron's optimizer-state key of each parameter.
        trained = dict(tr.model.named_parameters())
        moments = {f"{m}.{k}": make_sharded_optimizer_tensor(sh, torch.zeros_like(sh.data), f"optimizer.state.{m}")
                   for k, sh in other.model.sharded_state_dict().items() if k in trained for m in mc.MOMENTS}
        assert len(moments) == 2 * len(trained)
        got = dist_checkpointing.load(moments, str(folder))
        for key in moments:
            m, _, name = key.partition(".")
            assert torch.equal(got[key], adam[id(trained[name])][mc.MOMENTS.index(m)]), key
        assert all(float(v.abs().sum()) > 0 for _, v in adam.values())  # trained: no moment is all zeros
        assert got["resihp"]["optimizer_step"] == mc.load_common(folder)["resihp"]["optimizer_step"] == 2
    finally:
        run.close()
        ps.destroy_model_parallel()
