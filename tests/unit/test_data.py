"""Data sources: addressable, deterministic packing of real files; the registry and the
[data] configuration section."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resihp_core.config import Config, ConfigError, load_config
from resihp_core.data import DataError, DataSource, create_source
from resihp_core.data.text import TextSource
from resihp_core.hookspecs import hookimpl
from resihp_core.plugins import Plugins
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload

ROOT = Path(__file__).resolve().parents[2]


def make_corpus(root: Path, sizes: list[int], seed: int = 0) -> dict[str, bytes]:
    """Text files of the given sizes (bytes, including multi-byte UTF-8) under ``root``."""
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghij \n=()ü€"
    out = {}
    for i, n in enumerate(sizes):
        text = "".join(rng.choice(alphabet) for _ in range(n)).encode()[:n]
        rel = f"pkg{i % 3}/f{i:03d}.py"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text)
        out[rel] = text
    return out


def text_source(root: Path, n: int = 64, dp: int = 2, m: int = 3, **options) -> TextSource:
    section = {"source": "text", "root": str(root), "paths": ["**/*.py"], **options}
    src = create_source(section, dp=dp, num_microbatches=m, seed=0, token_budget=n, vocab_size=256)
    assert isinstance(src, TextSource)
    return src


SIZES = [5, 300, 17, 0, 64, 1, 129, 40, 900, 63, 2, 250]


# ------------------------------------------------------------------ packing
def test_every_micro_batch_holds_exactly_n_tokens_and_epochs_cover_every_document(tmp_path: Path) -> None:
    files = make_corpus(tmp_path, SIZES)
    src = text_source(tmp_path, n=64)
    assert src.vocab_size == 256 and src.index.documents == len([s for s in SIZES if s])  # empty file skipped
    total = sum(SIZES)
    covered: dict[int, list[tuple[int, int]]] = {}
    g = 0
    for it in range(total // (64 * 6) + 3):
        for r in range(2):
            for j in range(3):
                lengths = src.lengths(it, r, j)
                toks = src.tokens(it, r, j)
                assert sum(lengths) == 64 == len(toks) and all(x >= 1 for x in lengths)
                assert toks.dtype.name == "int64" and 0 <= toks.min() and toks.max() < 256
                pos = 0
                for (doc, start, length), l in zip(src.pieces(it, r, j), lengths):
                    assert length == l
                    rel = src.index.rel[int(src.index.doc_file[doc])]
                    assert bytes(toks[pos:pos + length].astype("uint8")) == files[rel][start:start + length]
                    pos += length
                    if g * 64 + pos <= total:  # first epoch
                        covered.setdefault(doc, []).append((start, length))
                g += 1
    # epoch 0: every document exactly once, in consecutive pieces from its first byte
    assert len(covered) == src.index.documents
    for doc, parts in covered.items():
        starts = [s for s, _ in parts]
        assert starts[0] == 0 and all(a + l == b for (a, l), b in zip(parts, starts[1:]))
        assert sum(l for _, l in parts) == int(src.index.doc_len[doc])


def test_a_document_longer_than_n_spills_into_the_next_micro_batches(tmp_path: Path) -> None:
    make_corpus(tmp_path, [1000])
    src = text_source(tmp_path, n=64, dp=1, m=2)
    assert [src.lengths(0, 0, j) for j in range(2)] == [(64,), (64,)]
    assert src.pieces(0, 0, 1) == ((0, 64, 64),)
    # 1000 = 15 x 64 + 40: micro-batch 15 ends the document and starts epoch 1's copy
    assert src.lengths(7, 0, 1) == (40, 24)


def test_a_corpus_smaller_than_one_micro_batch_repeats(tmp_path: Path) -> None:
    make_corpus(tmp_path, [10, 7])
    src = text_source(tmp_path, n=64, dp=1, m=1)
    assert sum(src.lengths(0, 0, 0)) == 64 and len(src.lengths(0, 0, 0)) >= 64 // 10


def test_shuffle_is_seeded_and_can_be_turned_off(tmp_path: Path) -> None:
    make_corpus(tmp_path, [20] * 30)
    plain = text_source(tmp_path, n=20, dp=1, m=1, shuffle=False)
    order = [plain.pieces(it, 0, 0)[0][0] for it in range(30)]
    assert order == list(range(30))  # path order
    shuffled = text_source(tmp_path, n=20, dp=1, m=1)
    perm = [shuffled.pieces(it, 0, 0)[0][0] for it in range(30)]
    assert sorted(perm) == list(range(30)) and perm != order
    epoch1 = [shuffled.pieces(it, 0, 0)[0][0] for it in range(30, 60)]
    assert sorted(epoch1) == list(range(30)) and epoch1 != perm  # a new order every epoch
    other = create_source({"source": "text", "root": str(tmp_path), "paths": "**/*.py"}, dp=1,
                          num_microbatches=1, seed=7, token_budget=20)
    assert [other.pieces(it, 0, 0)[0][0] for it in range(30)] != perm


def test_micro_batches_are_addressable_in_any_order(tmp_path: Path) -> None:
    make_corpus(tmp_path, SIZES)
    a = text_source(tmp_path, n=48)
    forward = {(it, r, j): a.tokens(it, r, j).tobytes() for it in range(6) for r in range(2) for j in range(3)}
    b = TextSource(a.opts, token_budget=48, dp=2, num_microbatches=3)  # fresh caches
    for key in sorted(forward, reverse=True):
        assert b.tokens(*key).tobytes() == forward[key]


def test_workload_and_label_count(tmp_path: Path) -> None:
    make_corpus(tmp_path, SIZES)
    src = text_source(tmp_path, n=64)
    wl = src.workload(2)
    assert set(wl) == {(r, j) for r in range(2) for j in range(3)}
    assert src.label_count(2) == sum(64 - len(v) for v in wl.values())
    with pytest.raises(DataError, match="dp=2"):
        src.workload(2, dp=3)
    with pytest.raises(IndexError, match="replica 2"):
        src.lengths(0, 2, 0)


# ------------------------------------------------------------------ jsonl
def test_jsonl_documents_come_from_the_configured_field(tmp_path: Path) -> None:
    lines = [{"content": "héllo wörld", "id": 1}, {"content": "x" * 100}, {"content": ""}, {"content": "abc"}]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n"
                                         + "\n".join(json.dumps(x) for x in lines[2:]) + "\n")
    src = create_source({"source": "text", "root": str(tmp_path), "paths": ["*.jsonl"], "text_field": "content",
                         "shuffle": False}, dp=1, num_microbatches=1, token_budget=16)
    docs = [x["content"].encode() for x in lines if x["content"]]
    assert src.index.documents == 3 and list(src.index.doc_len) == [len(d) for d in docs]
    stream = b"".join(docs)
    got = b"".join(bytes(src.tokens(it, 0, 0).astype("uint8")) for it in range(len(stream) // 16))
    assert got == stream[: len(got)]
    assert src.lengths(0, 0, 0) == (len(docs[0]), 16 - len(docs[0]))

    with pytest.raises(DataError, match=r"data\.text_field.*data\.jsonl:1 has no string field 'text'"):
        create_source({"source": "text", "root": str(tmp_path), "paths": ["*.jsonl"]}, dp=1,
                      num_microbatches=1, token_budget=16)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2 is not valid JSON"):
        create_source({"source": "text", "root": str(tmp_path), "paths": ["bad.jsonl"]}, dp=1,
                      num_microbatches=1, token_budget=16)


# ------------------------------------------------------------------ bad options
@pytest.mark.parametrize("section, field, match", [
    ({"source": "text"}, "data.paths", "is required"),
    ({"source": "text", "paths": []}, "data.paths", "at least one"),
    ({"source": "text", "paths": [3]}, "data.paths", "pattern"),
    ({"source": "text", "paths": "*.nothing"}, "data.paths", "no file matches"),
    ({"source": "text", "paths": "*.py", "pathz": 1}, "data.pathz", "did you mean 'paths'"),
    ({"source": "text", "paths": "*.py", "format": "csv"}, "data.format", "auto, text, jsonl"),
    ({"source": "text", "paths": "*.py", "shuffle": "yes"}, "data.shuffle", "must be bool"),
    ({"source": "text", "paths": "*.py", "min_doc_tokens": 0}, "data.min_doc_tokens", ">= 1"),
    ({"source": "text", "paths": "*.py", "root": "{nowhere}"}, "data.root", "unknown placeholder"),
    ({"source": "text", "paths": "*.py", "root": "/no/such/dir"}, "data.root", "not a directory"),
    ({"source": "text", "paths": "*.py", "token_budget": 32}, "data.token_budget", "training.token_budget"),
    ({"source": "text", "paths": "*.py", "fingerprint": "0000"}, "data.fingerprint", "same corpus"),
    ({"source": "nope"}, "data.source", "known: synthetic, text"),
    ({"source": "synthetic", "scale": -1.0}, "data.scale", "scale must be"),
    ({"source": "synthetic", "max_len": 1, "min_len": 4}, "data.max_len", "smaller than min_len"),
    ({"source": "synthetic", "sclae": 1.0}, "data.sclae", "did you mean 'scale'"),
])
def test_bad_options_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: dict, field: str,
                               match: str) -> None:
    make_corpus(tmp_path, [100, 200])
    monkeypatch.chdir(tmp_path / "pkg0")
    with pytest.raises(DataError, match=match) as err:
        create_source(section, dp=1, num_microbatches=2, token_budget=64, vocab_size=256)
    assert err.value.path == field, str(err.value)


def test_the_text_source_needs_a_byte_vocabulary(tmp_path: Path) -> None:
    make_corpus(tmp_path, [100])
    with pytest.raises(DataError, match="at least 256") as err:
        create_source({"source": "text", "root": str(tmp_path), "paths": "**/*.py"}, dp=1, num_microbatches=1,
                      token_budget=8, vocab_size=128)
    assert err.value.path == "model.vocab"


def test_stdlib_placeholder_and_spec_round_trip(tmp_path: Path) -> None:
    import sysconfig

    src = create_source({"source": "text", "root": "{stdlib}", "paths": ["json/*.py"]}, dp=1,
                        num_microbatches=2, token_budget=128)
    assert src.opts.root == os.path.abspath(sysconfig.get_paths()["stdlib"])
    assert "__init__.py" in " ".join(src.index.rel)
    spec = src.spec()
    assert spec["fingerprint"] == src.index.fingerprint and spec["token_budget"] == 128
    again = create_source(spec, dp=1, num_microbatches=2, token_budget=128)
    assert [again.tokens(3, 0, j).tobytes() for j in range(2)] == [src.tokens(3, 0, j).tobytes() for j in range(2)]


# ------------------------------------------------------------------ synthetic
def test_synthetic_lengths_are_the_predictor_corpus() -> None:
    corpus = dict(scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64, seed=3)
    src = create_source({"source": "synthetic", **corpus}, dp=2, num_microbatches=3, seed=5, vocab_size=100)
    assert src.workload(4) == iteration_workload(CorpusSpec(**corpus), 4, 2, 3)
    toks = src.tokens(4, 1, 2)
    assert len(toks) == 64 and toks.max() < 100 and src.spec() == {"source": "synthetic", "distribution": "lognormal",
                                                                    **corpus}


def test_synthetic_defaults_follow_the_token_budget() -> None:
    src = create_source({}, dp=1, num_microbatches=1, seed=2, token_budget=256)
    assert src.corpus == CorpusSpec(scale=25.6, shape=1.0, min_len=4, max_len=256, token_budget=256, seed=2)


# ------------------------------------------------------------------ processes
PROBE = """
import hashlib, json, sys
from resihp_core.data import create_source
section, n = json.loads(sys.argv[1]), int(sys.argv[2])
src = create_source(section, dp=2, num_microbatches=3, seed=1, token_budget=n, vocab_size=256)
h = hashlib.sha256()
for key in [(0, 0, 0), (5, 1, 2), (2, 0, 1), (40, 1, 0)]:
    h.update(repr(src.lengths(*key)).encode()); h.update(src.tokens(*key).tobytes())
print(h.hexdigest())
"""


def test_every_process_builds_the_same_micro_batches(tmp_path: Path) -> None:
    make_corpus(tmp_path / "c", SIZES)
    sections = [{"source": "text", "root": str(tmp_path / "c"), "paths": ["**/*.py"]},
                {"source": "synthetic", "scale": 20.0}]
    for section in sections:
        src = create_source(section, dp=2, num_microbatches=3, seed=1, token_budget=64, vocab_size=256)
        h = hashlib.sha256()
        for key in [(0, 0, 0), (5, 1, 2), (2, 0, 1), (40, 1, 0)]:
            h.update(repr(src.lengths(*key)).encode())
            h.update(src.tokens(*key).tobytes())
        for hashseed in ("1", "2"):
            out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(section), "64"], capture_output=True,
                                 text=True, timeout=120, cwd=tmp_path,
                                 env={**os.environ, "PYTHONHASHSEED": hashseed})
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == h.hexdigest(), section["source"]


# ------------------------------------------------------------------ registry and config
def test_a_plugin_data_source_is_created_by_name() -> None:
    class Constant(DataSource):
        name = "constant"

        def __init__(self, ctx) -> None:
            self.vocab_size, self.token_budget = 10, ctx.token_budget
            self.dp, self.num_microbatches = ctx.dp, ctx.num_microbatches

        def lengths(self, iteration, replica, mb):
            return (self.token_budget,)

        def tokens(self, iteration, replica, mb):
            import numpy as np

            return np.full(self.token_budget, iteration % 10, dtype=np.int64)

        def spec(self):
            return {"source": "constant"}

    class Plugin:
        @hookimpl
        def resihp_register_data_sources(self, registry):
            registry.register("constant", lambda options, ctx: Constant(ctx))

    plugins = Plugins(autoload=False)
    plugins.register(Plugin(), "constant-plugin")
    assert {"synthetic", "text", "constant"} <= set(plugins.data_sources().names())
    src = create_source({"source": "constant"}, dp=2, num_microbatches=2, token_budget=8, plugins=plugins)
    assert src.workload(0) == {(r, j): (8,) for r in range(2) for j in range(2)}
    assert list(src.tokens(3, 1, 1)) == [3] * 8


def test_config_data_section(tmp_path: Path) -> None:
    assert Config().data.section() == {"source": "synthetic"}
    path = tmp_path / "job.toml"
    path.write_text('[data]\nsource = "text"\nroot = "{stdlib}"\npaths = ["**/*.py"]\nexclude = ["site-packages/*"]\n'
                    'shuffle = false\n')
    cfg = load_config(path, env={"RESIHP_DATA__TEXT_FIELD": "body", "RESIHP_DATA__MIN_DOC_TOKENS": "8"})
    assert cfg.data.source == "text"
    assert cfg.data.section() == {"source": "text", "root": "{stdlib}", "paths": ["**/*.py"],
                                  "exclude": ["site-packages/*"], "shuffle": False, "text_field": "body",
                                  "min_doc_tokens": 8}
    dump = tmp_path / "dump.toml"
    dump.write_text(cfg.to_toml())
    assert load_config(dump, env={}) == cfg
    with pytest.raises(ConfigError, match=r"data\.paths.*string, number, boolean"):
        Config.from_dict({"data": {"source": "text", "paths": [{"a": 1}]}})
    with pytest.raises(ConfigError, match=r"data\.source.*must not be empty"):
        Config.from_dict({"data": {"source": " "}})


def test_example_config_builds_the_stdlib_corpus() -> None:
    cfg = load_config(ROOT / "examples" / "configs" / "stdlib_text.toml", env={})
    tr = cfg.training
    src = create_source(cfg.data.section(), dp=cfg.parallel.dp, num_microbatches=tr.microbatches, seed=tr.seed,
                        token_budget=tr.token_budget, vocab_size=cfg.model.vocab)
    assert isinstance(src, TextSource) and src.index.documents > 500
    assert not any(r.startswith("site-packages") for r in src.index.rel)
    lengths = [ls for it in range(50) for ls in src.workload(it).values()]
    assert all(sum(ls) == tr.token_budget for ls in lengths)
    assert any(len(ls) > 1 for ls in lengths)  # real documents shorter than N show up
