"""Synthetic long-tailed corpus packed into fixed-budget micro-batches."""

from __future__ import annotations

import statistics

import pytest

from resihp_core.predictor.corpus import (
    CorpusError,
    CorpusSpec,
    iteration_workload,
    packed_microbatches,
    sample_lengths,
    sum_sq,
)


def test_deterministic_under_seed() -> None:
    spec = CorpusSpec(token_budget=1024, scale=200, seed=7)
    assert packed_microbatches(spec, 20) == packed_microbatches(spec, 20)
    assert packed_microbatches(CorpusSpec(token_budget=1024, scale=200, seed=8), 20) != packed_microbatches(spec, 20)
    # A longer draw extends a shorter one (a stream, not a resample).
    assert packed_microbatches(spec, 30)[:20] == packed_microbatches(spec, 20)


@pytest.mark.parametrize("dist", ["lognormal", "pareto", "fixed"])
def test_every_microbatch_sums_to_budget(dist: str) -> None:
    spec = CorpusSpec(distribution=dist, scale=300, shape=1.3, min_len=8, max_len=5000, token_budget=777)
    mbs = packed_microbatches(spec, 200)
    assert len(mbs) == 200
    assert all(sum(mb) == 777 and all(l >= 1 for l in mb) for mb in mbs)


def test_documents_longer_than_budget_are_split() -> None:
    spec = CorpusSpec(distribution="fixed", scale=2500, min_len=1, max_len=10_000, token_budget=1000)
    # 2500-token documents: 1000 | 1000 | 500+500 | 1000 | 1000 | 500+...
    assert packed_microbatches(spec, 4) == [(1000,), (1000,), (500, 500), (1000,)]


def test_long_tail_present() -> None:
    spec = CorpusSpec(distribution="lognormal", scale=256, shape=1.2, min_len=16, max_len=16384)
    lengths = sample_lengths(spec, 5000)
    med = statistics.median(lengths)
    assert 200 < med < 320
    assert max(lengths) > 20 * med  # heavy right tail
    assert statistics.fmean(lengths) > 1.5 * med  # mean pulled up by the tail
    assert min(lengths) >= 16 and max(lengths) <= 16384
    pareto = sample_lengths(CorpusSpec(distribution="pareto", scale=64, shape=1.1, max_len=10**6), 5000)
    assert min(pareto) >= 64 and max(pareto) > 100 * 64


def test_sum_sq_varies_across_microbatches() -> None:
    spec = CorpusSpec(token_budget=2048, scale=256, shape=1.2)
    ssq = [sum_sq(mb) for mb in packed_microbatches(spec, 100)]
    assert max(ssq) > 5 * min(ssq)


def test_iteration_workload_is_deterministic_per_iteration() -> None:
    spec = CorpusSpec(token_budget=512, scale=100, seed=1)
    w = iteration_workload(spec, 5, dp=2, num_microbatches=3)
    assert sorted(w) == [(r, j) for r in range(2) for j in range(3)]
    assert all(sum(v) == 512 for v in w.values())
    assert w == iteration_workload(spec, 5, dp=2, num_microbatches=3)
    assert w != iteration_workload(spec, 6, dp=2, num_microbatches=3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(distribution="zipf"), "distribution"),
        (dict(scale=0), "scale"),
        (dict(shape=-1.0), "shape"),
        (dict(min_len=0), "min_len"),
        (dict(min_len=100, max_len=50), "max_len"),
        (dict(token_budget=0), "token_budget"),
        (dict(token_budget=1.5), "token_budget"),
    ],
)
def test_bad_parameters_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(CorpusError, match=match):
        CorpusSpec(**kwargs)


def test_bad_counts_raise() -> None:
    spec = CorpusSpec()
    with pytest.raises(CorpusError, match="count"):
        packed_microbatches(spec, -1)
    with pytest.raises(CorpusError, match="dp"):
        iteration_workload(spec, 0, dp=0, num_microbatches=2)
