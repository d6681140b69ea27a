"""The reference backend on data sources: the synthetic source is the old data path bit
for bit, and the text source trains the model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from resihp_core.data import create_source
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.job import JobSpec
from resihp_adapters.megatron_ref.adapter import data_spec
from resihp_adapters.megatron_ref.data import DataSpec, label_count, micro_batch
from resihp_adapters.megatron_ref.model import ModelConfig, make_labels
from resihp_adapters.megatron_ref.reference import reference_run

torch.set_num_threads(1)


def old_micro_batch(corpus: CorpusSpec, vocab: int, dp: int, m: int, seed: int, it: int, owner: int, mb: int):
    """The data path before data sources existed (torch's generator, corpus lengths)."""
    lengths = iteration_workload(corpus, it, dp, m)[(owner, mb)]
    key = hashlib.sha256(f"resihp-data/{seed}/{it}/{owner}/{mb}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    return tokens, make_labels(tokens, lengths), lengths


@pytest.mark.parametrize("vocab, budget", [(256, 64), (1000, 300), (50257, 40)])
def test_the_synthetic_source_is_the_old_data_path(vocab: int, budget: int) -> None:
    corpus = CorpusSpec(scale=budget / 5, shape=0.8, min_len=2, max_len=budget, token_budget=budget, seed=4)
    job = JobSpec(adapter="megatron_ref", adapter_config=dict(vocab_size=vocab),
                  data={"source": "synthetic", **corpus.__dict__}, dp=2, num_microbatches=3, seed=9)
    spec = data_spec(job)
    for it in range(3):
        old_count = sum(sum(ls) - len(ls) for ls in iteration_workload(corpus, it, 2, 3).values())
        assert label_count(spec, it) == old_count
        for owner in range(2):
            for mb in range(3):
                new = micro_batch(spec, it, owner, mb)
                tokens, labels, lengths = old_micro_batch(corpus, vocab, 2, 3, 9, it, owner, mb)
                assert new.lengths == lengths
                assert torch.equal(new.tokens, tokens) and torch.equal(new.labels, labels)


def test_the_default_config_trains_on_the_same_corpus_as_before(tmp_path: Path) -> None:
    from resihp_core.config import Config
    from resihp_core.runtime.controller.jobs import build_job
    from resihp_plugins.demo import DEMO_CONFIG

    spec = build_job(Config.from_dict(DEMO_CONFIG), [], tmp_path).spec
    n = 256
    corpus = {k: v for k, v in spec.data.items() if k != "source"}
    assert spec.data["source"] == "synthetic"
    assert CorpusSpec(**corpus) == CorpusSpec(scale=25.6, shape=1.0, min_len=4, max_len=n, token_budget=n, seed=0)


def test_the_text_source_trains_the_reference_model(tmp_path: Path) -> None:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    source = create_source({"source": "text", "root": str(root), "paths": ["json/*.py", "email/*.py"]},
                           dp=2, num_microbatches=2, seed=0, token_budget=128, vocab_size=256)
    model = ModelConfig(vocab_size=256, hidden=32, num_heads=4, ffn_hidden=64, num_layers=2, dtype="float64")
    _, losses = reference_run(model, DataSpec(source), 12, lr=1e-2)
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # uniform at the start
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses  # it learns the bytes of Python source
    # a job spec carrying the resolved [data] section rebuilds the very same source
    job = JobSpec(adapter="megatron_ref", adapter_config=dict(vocab_size=256), data=source.spec(), dp=2,
                  num_microbatches=2)
    rebuilt = data_spec(job)
    b, c = micro_batch(rebuilt, 5, 1, 1), micro_batch(DataSpec(source), 5, 1, 1)
    assert torch.equal(b.tokens, c.tokens) and b.lengths == c.lengths
