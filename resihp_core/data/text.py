"""The ``text`` data source: local text and JSONL files, byte-level tokens, packed.

Documents: every matched file is one document (``.py``, ``.txt``, ...), except JSONL
files (``.jsonl`` / ``.ndjson``, or ``format = "jsonl"``) where every non-blank line
is a JSON object and its ``text_field`` string is one document. Tokens are the
document's bytes (UTF-8 for JSONL text), so the vocabulary is 256 and nothing is
downloaded; document boundaries travel as lengths (per-document attention), not as
special tokens.

Packing, deterministic and addressable (docs/data.md):

1. the corpus is indexed once per process: matched files sorted by path, each
   document's file, byte offset and token count (a JSONL file is scanned once);
   nothing else is kept in memory;
2. epoch ``e`` orders the documents by a seeded hash of ``(seed, e, document)``
   (``shuffle = false``: path order) and lays them end to end: a stream of T tokens,
   with cumulative offsets per epoch (cached for the last two epochs);
3. micro-batch ``(iteration, replica, mb)`` is global micro-batch
   ``g = (iteration * dp + replica) * m + mb`` and holds stream tokens
   ``[g N, (g + 1) N)`` of the endless sequence of epochs: exactly N tokens; a
   document crossing the boundary is split and its tail opens the next micro-batch.

Finding a micro-batch's documents is a binary search; its tokens are read from the
files on demand (a small cache of decoded JSONL documents), so memory stays bounded
for a large corpus. A ``fingerprint`` (paths, sizes, document count) in the spec
makes a worker whose files differ from the controller's fail loudly.

Options: ``paths`` (required: glob patterns, ``**`` recursive, relative to ``root``),
``root`` (default: the current directory; ``{stdlib}`` and the other
``sysconfig.get_paths()`` names expand), ``exclude`` (fnmatch patterns on the path
relative to ``root``; ``*`` crosses directories), ``format`` (``auto``, ``text``,
``jsonl``), ``text_field`` (``text``), ``shuffle`` (true), ``min_doc_tokens`` (1),
``fingerprint``, ``token_budget``.
"""

from __future__ import annotations

import fnmatch
import glob
from array import array
import hashlib
import json
import os
import sysconfig
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

from resihp_core.data.source import DataError, DataSource, SourceContext, check_known, option, resolve_budget

__all__ = ["BYTE_VOCAB", "TextSource", "make_text"]

#: Byte-level tokens: ids 0..255.
BYTE_VOCAB = 256
FORMATS = ("auto", "text", "jsonl")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_OPTIONS = {"paths", "root", "exclude", "format", "text_field", "shuffle", "min_doc_tokens",
            "fingerprint", "token_budget"}


@dataclass(frozen=True)
class TextOptions:
    root: str  # absolute
    paths: tuple[str, ...]
    exclude: tuple[str, ...]
    format: str
    text_field: str
    shuffle: bool
    min_doc_tokens: int
    fingerprint: str | None


def _expand(text: str, field: str) -> str:
    """``{stdlib}`` and the other ``sysconfig.get_paths()`` names, then ``~``."""
    try:
        out = text.format_map(sysconfig.get_paths())
    except KeyError as e:
        raise DataError(f"unknown placeholder {{{e.args[0]}}} (known: "
                        f"{', '.join('{' + k + '}' for k in sorted(sysconfig.get_paths()))})",
                        field=field, value=text) from None
    except (ValueError, IndexError):
        raise DataError("malformed placeholder: write {name}, and {{ }} for braces", field=field,
                        value=text) from None
    return os.path.expanduser(out)


def _str_list(options: Mapping[str, Any], name: str, default: tuple[str, ...] | None) -> tuple[str, ...]:
    if name not in options:
        if default is None:
            raise DataError("is required: glob patterns of the files to train on", field=name)
        return default
    v = options[name]
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) and x.strip() for x in items):
        raise DataError("must be a pattern or a list of non-empty pattern strings", field=name, value=v)
    return tuple(items)


def parse_options(options: Mapping[str, Any]) -> TextOptions:
    """Validate the section (no file is touched)."""
    check_known(options, _OPTIONS, "text")
    paths = _str_list(options, "paths", None)
    if not paths:
        raise DataError("must name at least one pattern", field="paths", value=list(paths))
    root = option(options, "root", str, "")
    fmt = option(options, "format", str, "auto")
    if fmt not in FORMATS:
        raise DataError(f"must be one of {', '.join(FORMATS)}", field="format", value=fmt)
    field = option(options, "text_field", str, "text")
    if not field:
        raise DataError("must not be empty", field="text_field", value=field)
    fp = option(options, "fingerprint", str, None)
    return TextOptions(
        root=os.path.abspath(_expand(root, "root") or "."),
        paths=tuple(_expand(p, "paths") for p in paths),
        exclude=_str_list(options, "exclude", ()),
        format=fmt, text_field=field,
        shuffle=option(options, "shuffle", bool, True),
        min_doc_tokens=option(options, "min_doc_tokens", int, 1, minimum=1),
        fingerprint=fp,
    )


class _Index:
    """Where every document is: file, byte offset, byte span, token count."""

    def __init__(self, opts: TextOptions) -> None:
        import numpy as np

        if not os.path.isdir(opts.root):
            raise DataError("is not a directory", field="root", value=opts.root)
        found: dict[str, str] = {}
        for pattern in opts.paths:
            full = pattern if os.path.isabs(pattern) else os.path.join(opts.root, pattern)
            for path in glob.glob(full, recursive=True):
                if not os.path.isfile(path):
                    continue
                rel = os.path.relpath(path, opts.root)
                if any(fnmatch.fnmatchcase(rel, x) for x in opts.exclude):
                    continue
                found.setdefault(rel, os.path.abspath(path))
        if not found:
            raise DataError(f"no file matches under root {opts.root!r} (exclude: {list(opts.exclude)})",
                            field="paths", value=list(opts.paths))
        self.rel = sorted(found)
        self.files = [found[r] for r in self.rel]
        self.jsonl = [opts.format == "jsonl" or (opts.format == "auto" and r.lower().endswith(JSONL_SUFFIXES))
                      for r in self.rel]
        # Typed arrays while scanning: 28 bytes per document, not four Python ints.
        doc_file, doc_offset, doc_bytes, doc_len = array("i"), array("q"), array("q"), array("q")

        def add(i: int, offset: int, span: int, n: int) -> None:
            if n >= opts.min_doc_tokens:
                doc_file.append(i)
                doc_offset.append(offset)
                doc_bytes.append(span)
                doc_len.append(n)

        digest = hashlib.sha256()
        for i, (rel, path) in enumerate(zip(self.rel, self.files)):
            size = os.path.getsize(path)
            digest.update(f"{rel}\t{size}\n".encode())
            if not self.jsonl[i]:
                add(i, 0, size, size)
                continue
            for offset, span, n in _scan_jsonl(path, rel, opts.text_field):
                add(i, offset, span, n)
        if not doc_len:
            raise DataError(f"the {len(self.files)} matched files hold no document of at least "
                            f"min_doc_tokens = {opts.min_doc_tokens} tokens", field="paths",
                            value=list(opts.paths))
        self.doc_file = np.frombuffer(doc_file, dtype=np.int32)
        self.doc_offset = np.frombuffer(doc_offset, dtype=np.int64)
        self.doc_bytes = np.frombuffer(doc_bytes, dtype=np.int64)
        self.doc_len = np.frombuffer(doc_len, dtype=np.int64)
        self.total = int(self.doc_len.sum())
        digest.update(f"{len(doc_len)} documents, {self.total} tokens".encode())
        self.fingerprint = digest.hexdigest()[:16]

    @property
    def documents(self) -> int:
        return len(self.doc_len)


def _scan_jsonl(path: str, rel: str, field: str):
    """(byte offset, byte span, token count) of every document line of a JSONL file."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            span = len(line)
            if line.strip():
                text = _jsonl_text(line, rel, lineno, field)
                yield offset, span, len(text)
            offset += span


def _jsonl_text(line: bytes, rel: str, lineno: int, field: str) -> bytes:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{rel}:{lineno} is not valid JSON ({e})", field="paths") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        raise DataError(f"{rel}:{lineno} has no string field {field!r}", field="text_field", value=field)
    return obj[field].encode("utf-8")


def _mix64(x: Any) -> Any:
    """splitmix64's finaliser on a uint64 array: our own, so the document order never
    depends on a numpy version's shuffling algorithm."""
    import numpy as np

    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class TextSource(DataSource):
    """Documents from local files packed into N-token micro-batches (module docstring)."""

    name = "text"
    vocab_size = BYTE_VOCAB

    def __init__(self, opts: TextOptions, *, token_budget: int, dp: int, num_microbatches: int,
                 seed: int = 0) -> None:
        self.opts = opts
        self.token_budget, self.dp, self.num_microbatches, self.seed = token_budget, dp, num_microbatches, seed
        self.index = _Index(opts)
        if opts.fingerprint is not None and opts.fingerprint != self.index.fingerprint:
            raise DataError(f"the files found here ({self.index.documents} documents under "
                            f"{opts.root}) differ from the ones the job was built from "
                            f"(fingerprint {self.index.fingerprint}); every host needs the same corpus",
                            field="fingerprint", value=opts.fingerprint)
        self._epochs: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
        self._pieces: OrderedDict[int, tuple[tuple[int, int, int], ...]] = OrderedDict()
        self._docs: OrderedDict[int, bytes] = OrderedDict()  # decoded JSONL documents
        self._docs_bytes = 0

    # ------------------------------------------------------------- addressing
    def _epoch(self, epoch: int) -> tuple[Any, Any]:
        """(document order, cumulative token offsets) of one pass over the corpus."""
        hit = self._epochs.get(epoch)
        if hit is not None:
            return hit
        import numpy as np

        d = self.index.documents
        if self.opts.shuffle:
            salt = int.from_bytes(hashlib.sha256(f"resihp-text/{self.seed}/{epoch}".encode()).digest()[:8], "little")
            keys = _mix64(np.arange(d, dtype=np.uint64) ^ np.uint64(salt))
            order = np.argsort(keys, kind="stable")
        else:
            order = np.arange(d)
        cum = np.zeros(d + 1, dtype=np.int64)
        np.cumsum(self.index.doc_len[order], out=cum[1:])
        self._epochs[epoch] = (order, cum)
        while len(self._epochs) > 2:
            self._epochs.popitem(last=False)
        return order, cum

    def pieces(self, iteration: int, replica: int, mb: int) -> tuple[tuple[int, int, int], ...]:
        """``(document, first token within it, length)`` of every document piece of the
        micro-batch, in order."""
        import numpy as np

        self.check_address(iteration, replica, mb)
        g = (iteration * self.dp + replica) * self.num_microbatches + mb
        hit = self._pieces.get(g)
        if hit is not None:
            return hit
        n, total = self.token_budget, self.index.total
        pos, end = g * n, (g + 1) * n
        out = []
        while pos < end:
            epoch, off = divmod(pos, total)
            order, cum = self._epoch(epoch)
            k = int(np.searchsorted(cum, off, side="right")) - 1
            take = min(int(cum[k + 1]) - off, end - pos)
            out.append((int(order[k]), off - int(cum[k]), take))
            pos += take
        pieces = tuple(out)
        self._pieces[g] = pieces
        while len(self._pieces) > 1024:
            self._pieces.popitem(last=False)
        return pieces

    def lengths(self, iteration: int, replica: int, mb: int) -> tuple[int, ...]:
        return tuple(p[2] for p in self.pieces(iteration, replica, mb))

    # ------------------------------------------------------------- reading
    def _read(self, doc: int, start: int, length: int) -> bytes:
        ix = self.index
        f = int(ix.doc_file[doc])
        rel = ix.rel[f]
        if not ix.jsonl[f]:
            with open(ix.files[f], "rb") as fh:
                fh.seek(int(ix.doc_offset[doc]) + start)
                data = fh.read(length)
            if len(data) != length:
                raise DataError(f"{rel} changed after it was indexed (it is shorter now)", field="paths")
            return data
        text = self._docs.get(doc)
        if text is None:
            with open(ix.files[f], "rb") as fh:
                fh.seek(int(ix.doc_offset[doc]))
                line = fh.read(int(ix.doc_bytes[doc]))
            text = _jsonl_text(line, rel, 0, self.opts.text_field)
            if len(text) != int(ix.doc_len[doc]):
                raise DataError(f"{rel} changed after it was indexed", field="paths")
            self._docs[doc] = text
            self._docs_bytes += len(text)
            while self._docs_bytes > 64 * 2**20 and len(self._docs) > 1:
                _, old = self._docs.popitem(last=False)
                self._docs_bytes -= len(old)
        else:
            self._docs.move_to_end(doc)
        return text[start:start + length]

    def tokens(self, iteration: int, replica: int, mb: int) -> Any:
        import numpy as np

        data = b"".join(self._read(*p) for p in self.pieces(iteration, replica, mb))
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    # ------------------------------------------------------------- description
    def spec(self) -> dict[str, Any]:
        o = self.opts
        return {"source": self.name, "root": o.root, "paths": list(o.paths), "exclude": list(o.exclude),
                "format": o.format, "text_field": o.text_field, "shuffle": o.shuffle,
                "min_doc_tokens": o.min_doc_tokens, "fingerprint": self.index.fingerprint,
                "token_budget": self.token_budget}

    def describe(self) -> str:
        ix = self.index
        return (f"text: {len(ix.files)} files, {ix.documents} documents, {ix.total} tokens under "
                f"{self.opts.root} (fingerprint {ix.fingerprint})")


def make_text(options: Mapping[str, Any], ctx: SourceContext) -> TextSource:
    opts = parse_options(options)
    n = resolve_budget(options, ctx, default=None)
    if ctx.vocab_size is not None and ctx.vocab_size < BYTE_VOCAB:
        raise DataError(f"the text source's byte tokens need a vocabulary of at least {BYTE_VOCAB}",
                        path="model.vocab", value=ctx.vocab_size)
    return TextSource(opts, token_budget=n, dp=ctx.dp, num_microbatches=ctx.num_microbatches, seed=ctx.seed)
