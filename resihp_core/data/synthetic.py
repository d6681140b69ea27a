"""The ``synthetic`` data source: long-tailed document lengths, random token ids.

Lengths come from :mod:`resihp_core.predictor.corpus` (:func:`iteration_workload`),
so the controller's predictor and the workers agree on them. Token ids of micro-batch
``(iteration, replica, mb)`` are drawn from an MT19937 generator seeded by
``sha256("resihp-data/{seed}/{iteration}/{replica}/{mb}")`` as ``raw % vocab_size``:
bit for bit what ``torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(s))``
gives (torch's CPU generator is MT19937 seeded with the low 32 bits of ``s`` and
draws one 32-bit word per id below 2**32), so ResiHP's earlier runs keep their numbers
while the source itself needs no torch.

Options (all optional; ``N`` is the token budget):
``distribution`` (``lognormal``), ``scale`` (max(2, N/10)), ``shape`` (1.0),
``min_len`` (min(4, N)), ``max_len`` (N), ``seed`` (the job's seed: the length
stream), ``token_budget`` (must equal ``training.token_budget`` when both are given).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import asdict, fields
from typing import Any, Mapping

from resihp_core.data.source import DataError, DataSource, SourceContext, check_known, option, resolve_budget
from resihp_core.predictor.corpus import CorpusError, CorpusSpec, iteration_workload

__all__ = ["SyntheticSource", "make_synthetic", "token_seed"]

_CORPUS_FIELDS = {f.name for f in fields(CorpusSpec)}


def token_seed(seed: int, iteration: int, replica: int, mb: int) -> int:
    """The 63-bit seed of one micro-batch's token ids (the old data path's seed)."""
    key = hashlib.sha256(f"resihp-data/{seed}/{iteration}/{replica}/{mb}".encode()).digest()
    return int.from_bytes(key[:8], "little") & (2**63 - 1)


class SyntheticSource(DataSource):
    """Lengths from ``corpus``, token ids seeded by ``(seed, iteration, replica, mb)``."""

    name = "synthetic"

    def __init__(self, corpus: CorpusSpec, *, dp: int, num_microbatches: int, seed: int = 0,
                 vocab_size: int = 256) -> None:
        if vocab_size < 1 or vocab_size > 2**32:
            raise DataError(f"must be in [1, 2**32], got {vocab_size}", path="model.vocab")
        self.corpus = corpus
        self.dp, self.num_microbatches, self.seed = dp, num_microbatches, seed
        self.vocab_size = vocab_size
        self.token_budget = corpus.token_budget
        self._iterations: OrderedDict[int, dict[tuple[int, int], tuple[int, ...]]] = OrderedDict()

    def _workload(self, iteration: int) -> dict[tuple[int, int], tuple[int, ...]]:
        wl = self._iterations.get(iteration)
        if wl is None:
            wl = iteration_workload(self.corpus, iteration, self.dp, self.num_microbatches)
            self._iterations[iteration] = wl
            while len(self._iterations) > 16:
                self._iterations.popitem(last=False)
        return wl

    def lengths(self, iteration: int, replica: int, mb: int) -> tuple[int, ...]:
        self.check_address(iteration, replica, mb)
        return self._workload(iteration)[(replica, mb)]

    def tokens(self, iteration: int, replica: int, mb: int) -> Any:
        import numpy as np

        n = sum(self.lengths(iteration, replica, mb))
        state = np.random.RandomState(token_seed(self.seed, iteration, replica, mb) & 0xFFFFFFFF)
        gen = np.random.MT19937()
        gen.state = state.get_state(legacy=False)
        raw = gen.random_raw(n)  # 32-bit words, as uint64
        return (raw % np.uint64(self.vocab_size)).astype(np.int64)

    def spec(self) -> dict[str, Any]:
        return {"source": self.name, **asdict(self.corpus)}


def make_synthetic(options: Mapping[str, Any], ctx: SourceContext) -> SyntheticSource:
    check_known(options, _CORPUS_FIELDS, "synthetic")
    n = resolve_budget(options, ctx, default=CorpusSpec.token_budget)
    values: dict[str, Any] = {
        "distribution": option(options, "distribution", str, "lognormal"),
        "scale": option(options, "scale", float, max(2.0, n / 10)),
        "shape": option(options, "shape", float, 1.0),
        "min_len": option(options, "min_len", int, min(4, n)),
        "max_len": option(options, "max_len", int, n),
        "token_budget": n,
        "seed": option(options, "seed", int, ctx.seed, minimum=0),
    }
    try:
        corpus = CorpusSpec(**values)
    except CorpusError as e:
        field = next((f for f in sorted(_CORPUS_FIELDS, key=len, reverse=True) if str(e).startswith(f)), None)
        raise DataError(str(e), field=field) from None
    return SyntheticSource(corpus, dp=ctx.dp, num_microbatches=ctx.num_microbatches, seed=ctx.seed,
                           vocab_size=ctx.vocab_size or 256)
