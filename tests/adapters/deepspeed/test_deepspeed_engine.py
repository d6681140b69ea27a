"""ResiHP's DeepSpeed engine is DeepSpeed: fault-free it trains exactly as stock
``deepspeed.initialize`` + ``train_batch``; across plan generations rebuilt in the same
processes (DP work migration, layer repartition, replica drop, standbys rejoining) it
matches a single-process float64 reference with the same micro-batch accounting."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402
import _scenario as S  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp,dp", [(2, 2), (4, 2)], ids=["4proc-PP2xDP2", "8proc-PP4xDP2"])
def test_fault_free_equals_stock_deepspeed(tmp_path, pp, dp):
    """4 and 8 gloo processes: the same losses, parameters and ``eval_batch`` losses as
    stock DeepSpeed (float64; identical here, the bound is 1e-9 relative), and both equal
    the reference."""
    iters, world = 3, pp * dp
    rc = _launch.run_ranks("_fidelity_worker.py", world, ["--iters", str(iters), "--pp", str(pp), "--dp", str(dp)],
                           280, str(tmp_path))
    assert rc == [0] * world, _launch.tail(str(tmp_path), world)
    ref, ref_losses = S.reference([S.DP] * iters)
    seen = set()
    for r in range(world):
        d = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        stock, ours = d["stock"], d["resihp"]
        assert set(stock["params"]) == set(ours["params"])
        for k in stock["params"]:
            assert _rel(ours["params"][k], stock["params"][k]) <= 1e-9, k
            assert _rel(ours["params"][k], ref[k]) <= 1e-9, k
            seen.add(k)
        if d["stage"] == pp - 1:  # losses live on the last stage
            for a, b, c in zip(ours["losses"], stock["losses"], ref_losses):
                assert abs(a - b) <= 1e-9 * abs(b) and abs(a - c) <= 1e-9 * abs(c)
        # eval_batch: DeepSpeed's inference schedule on both engines, the same loss.
        assert abs(ours["eval"] - stock["eval"]) <= 1e-9 * abs(stock["eval"]) and stock["eval"] > 0, d["stage"]
    assert seen == set(ref), "some layer was held by no rank"


@pytest.mark.timeout(240)
def test_generations_rebuilt_in_process_match_reference(tmp_path):
    """Five plan generations in the same 4 processes: every device keeps its PID, the
    standbys of generation 3 run nothing, and the final parameters and every loss equal
    the reference's (float64, <= 1e-9 relative)."""
    rc = _launch.run_ranks("_generations_worker.py", 4, [], 200, str(tmp_path))
    assert rc == [0] * 4, _launch.tail(str(tmp_path), 4)
    gens = S.generations()
    dps = [p.dp for p, n in gens for _ in range(n)]
    ref, ref_losses = S.reference(dps)
    total = sum(n for _, n in gens)
    seen = set()
    for dev in range(4):
        d = torch.load(tmp_path / f"dev{dev}.pt", weights_only=False)
        assert len({g["pid"] for g in d["log"]}) == 1, f"device {dev} changed process"
        assert d["iteration"] == total
        for g, (plan, _) in zip(d["log"], gens):
            assert g["active"] == (plan.location(dev) is not None), (dev, plan.generation)
        for k, v in d["params"].items():
            assert _rel(v, ref[k]) <= 1e-9, (dev, k)
            seen.add(k)
        it = 0
        for g, (plan, n) in zip(d["log"], gens):
            for i, loss in enumerate(g.get("losses", [])):
                if loss is not None:
                    assert abs(loss - ref_losses[it + i]) <= 1e-9 * ref_losses[it + i], (dev, it + i)
            it += n
    assert seen == set(ref)
