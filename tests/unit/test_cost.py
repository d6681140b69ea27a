"""Micro-batch cost model, plan vertex times and link model."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from resihp_core.plan import Migration, ParallelPlan
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload, packed_microbatches, sum_sq
from resihp_core.predictor.cost import (
    CostModel,
    CostModelError,
    LinkModel,
    StageCost,
    fit_stage,
    mape,
    vertex_times,
)

ROOT = Path(__file__).resolve().parents[2]
A_F, B_F, A_B, B_B = 2e-5, 3e-8, 4e-5, 7e-8


def _samples(mbs: list[tuple[int, ...]], noise: float = 0.0, gamma: float = 0.0) -> list:
    rng = random.Random(0)
    out = []
    for mb in mbs:
        n, s = sum(mb), sum_sq(mb)
        f = (A_F * n + B_F * s + gamma) * (1 + rng.gauss(0, noise))
        b = (A_B * n + B_B * s + 2 * gamma) * (1 + rng.gauss(0, noise))
        out.append((mb, f, b))
    return out


def test_least_squares_recovers_coefficients_exactly() -> None:
    mbs = packed_microbatches(CorpusSpec(token_budget=2048, scale=256), 12)
    c = fit_stage(_samples(mbs), ref_layers=2)
    assert c.alpha_f == pytest.approx(A_F, rel=1e-9)
    assert c.beta_f == pytest.approx(B_F, rel=1e-9)
    assert c.alpha_b == pytest.approx(A_B, rel=1e-9)
    assert c.beta_b == pytest.approx(B_B, rel=1e-9)
    assert c.gamma_f == 0.0 and c.ref_layers == 2  # constant N: γ folded into α


def test_per_document_term_is_recovered() -> None:
    mbs = packed_microbatches(CorpusSpec(token_budget=2048, scale=256), 12)
    delta = 1e-4
    samples = [(l, f + delta * len(l), b + 2 * delta * len(l)) for l, f, b in _samples(mbs)]
    c = fit_stage(samples, per_document=True)
    assert c.delta_f == pytest.approx(delta, rel=1e-6)
    assert c.delta_b == pytest.approx(2 * delta, rel=1e-6)
    assert c.beta_f == pytest.approx(B_F, rel=1e-6)
    assert c.forward((1000, 1000, 48)) == pytest.approx(A_F * 2048 + B_F * 2_002_304 + 3 * delta)
    assert fit_stage(_samples(mbs)).delta_f == 0.0  # off unless asked for


def test_least_squares_with_noise_and_intercept() -> None:
    spec_a = CorpusSpec(token_budget=2048, scale=256)
    spec_b = CorpusSpec(token_budget=1024, scale=128)
    mbs = packed_microbatches(spec_a, 100) + packed_microbatches(spec_b, 100)
    c = fit_stage(_samples(mbs, noise=0.01, gamma=1e-3))  # N varies: γ is fitted
    assert c.alpha_f == pytest.approx(A_F, rel=0.05)
    assert c.beta_f == pytest.approx(B_F, rel=0.05)
    assert c.beta_b == pytest.approx(B_B, rel=0.05)
    assert c.gamma_f == pytest.approx(1e-3, rel=0.3)
    held = packed_microbatches(spec_a, 50, stream="test")
    truth = _samples(held, gamma=1e-3)
    assert mape([c.forward(l) for l, _, _ in truth], [f for _, f, _ in truth]) < 1.0


def test_rank_deficient_warmup_raises() -> None:
    same = [((512, 512, 512, 512), 1.0, 2.0)] * 5
    with pytest.raises(CostModelError, match="same Σ l²"):
        fit_stage(same)
    # Every document the same length: Σ l² = N·L is proportional to N.
    prop = [((256,) * k, 0.1 * k, 0.2 * k) for k in (2, 4, 8)]
    with pytest.raises(CostModelError, match="rank-deficient"):
        fit_stage(prop, intercept=False)
    with pytest.raises(CostModelError, match="at least 3"):
        fit_stage(_samples([(100, 28), (64, 64)]))
    with pytest.raises(CostModelError, match="sample 0"):
        fit_stage([((10,), "x", 1.0)] * 3)


def test_scaling_by_layers_tp_speed() -> None:
    c = StageCost(alpha_f=1e-3, beta_f=1e-6, alpha_b=2e-3, beta_b=2e-6, gamma_f=0.5,
                  ref_layers=4, ref_tp=2, w_fraction=0.25)
    lengths = (10, 20)
    base = 1e-3 * 30 + 1e-6 * 500 + 0.5
    assert c.forward(lengths) == pytest.approx(base)
    assert c.forward(lengths, layers=8) == pytest.approx(2 * base)
    assert c.forward(lengths, tp=4) == pytest.approx(base / 2)
    assert c.forward(lengths, tp=1, layers=2) == pytest.approx(base)
    assert c.forward(lengths, speed=0.5) == pytest.approx(2 * base)
    b = c.backward(lengths)
    assert b == pytest.approx(2e-3 * 30 + 2e-6 * 500)
    assert c.backward_input(lengths) + c.backward_weight(lengths) == pytest.approx(b)
    assert c.backward_weight(lengths) == pytest.approx(0.25 * b)
    with pytest.raises(CostModelError, match="speed"):
        c.forward(lengths, speed=0.0)
    with pytest.raises(CostModelError, match="tp"):
        c.forward(lengths, tp=0)
    with pytest.raises(CostModelError, match="lengths"):
        c.forward((0, 3))


def test_vertex_times_for_a_heterogeneous_plan() -> None:
    base = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=2)
    # Replica 1 stage 1 shrank to TP 1 and took 3 layers; its mb 1 runs on replica 0.
    plan = base.with_(
        layer_ranges=((0, 1), (1, 4)),
        tp_groups=(base.tp_groups[0], (base.tp_groups[1][0], (6,))),
        migrations=(Migration(stage=1, replica=1, mb=1, to=0),),
    )
    work = iteration_workload(CorpusSpec(token_budget=64, scale=16), 0, 2, 2)
    sc = StageCost(alpha_f=1.0, beta_f=0.01, alpha_b=2.0, beta_b=0.02, ref_layers=1, ref_tp=1)
    speeds = {4: 0.5, 5: 1.0, 6: 0.8}  # devices 4, 5 run replica 0 stage 1
    vt = vertex_times(plan, work, CostModel.uniform(sc, 2), speeds, split=False)
    assert {k[0] for k in vt} == {"F", "B"} and len(vt) == 2 * 2 * 2 * 2
    l = work[(1, 1)]
    # Migrated: executed by replica 0 (TP 2, slowest device 0.5), stage 1 has 3 layers.
    assert vt[("F", 0, 1, 1, 1)] == pytest.approx(sc.forward(l) * 3 / 2 / 0.5)
    l = work[(1, 0)]
    assert vt[("B", 1, 1, 1, 0)] == pytest.approx(sc.backward(l) * 3 / 1 / 0.8)
    split = vertex_times(plan, work, CostModel.uniform(sc, 2), speeds, split=True)
    key = ("B", 1, 1, 1, 0)
    assert split[key] + split[("W",) + key[1:]] == pytest.approx(vt[key])
    with pytest.raises(CostModelError, match="stages"):
        vertex_times(plan, work, CostModel.uniform(sc, 3))
    with pytest.raises(CostModelError, match="mb 1"):
        vertex_times(plan, {k: v for k, v in work.items() if k != (0, 1)}, CostModel.uniform(sc, 2))


def test_link_model_arithmetic() -> None:
    lm = LinkModel()
    assert lm.inter_bandwidth == 25e9 and lm.intra_bandwidth == 300e9
    assert lm.p2p(25e9, same_node=False) == pytest.approx(1.0 + 10e-6)
    assert lm.p2p(0, same_node=True) == 0.0
    assert lm.allreduce(1e9, 1, True) == 0.0
    assert lm.allreduce(300e9, 4, True) == pytest.approx(2 * 3 / 4 + 2 * 3 * 5e-6)
    assert lm.allgather(300e9, 4, True) == pytest.approx(3 / 4 + 3 * 5e-6)
    assert lm.tp_per_layer(1000, 100, 2, dtype_bytes=2) == pytest.approx(2 * lm.allreduce(2e5, 2, True))
    # docs/design.md §5.1: each byte crosses the inter-node link once, split over max(degrees) chunks.
    nbytes = 8e9
    equal = lm.stage_p2p(nbytes, 4, 4)
    assert equal == pytest.approx(10e-6 + nbytes / 4 / 25e9 + lm.allgather(nbytes, 4, True))
    down = lm.stage_p2p(nbytes, 4, 2)  # 4 chunks, 2 per receiver GPU
    assert down == pytest.approx(2 * (10e-6 + nbytes / 4 / 25e9) + lm.allgather(nbytes, 2, True))
    one = lm.stage_p2p(nbytes, 1, 1)
    assert one == pytest.approx(lm.p2p(nbytes, same_node=False))
    with pytest.raises(CostModelError):
        LinkModel(inter_bandwidth=0)
    with pytest.raises(CostModelError):
        lm.stage_p2p(1.0, 0, 2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_benchmark_quick_writes_metrics(tmp_path: Path) -> None:
    out = tmp_path / "pred.json"
    proc = subprocess.run(
        # The output's shape, not the accuracy (the benchmark's own business): few repeats.
        [sys.executable, str(ROOT / "benchmarks" / "predictor_accuracy.py"), "--quick", "--json", str(out),
         "--repeats", "3", "--max-repeats", "3", "--warmup-mbs", "8", "--test-mbs", "6"],
        capture_output=True, text=True, timeout=170, cwd=ROOT,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "total MAPE" in proc.stdout
    data = json.loads(out.read_text())
    for key in ("mape_forward_pct", "mape_backward_pct", "mape_total_pct", "alpha_f", "beta_b"):
        assert isinstance(data[key], float) and data[key] >= 0, key
    assert data["config"]["quick"] is True and data["config"]["tokens"] > 0
