"""Training data for ResiHP jobs: data sources and their registry.

A :class:`DataSource` tells every process which documents (lengths) and which token
ids make up micro-batch ``(iteration, replica, mb)``, deterministically and without
reading the stream in order. Sources are plugins (hook
``resihp_register_data_sources``); the built-ins are ``synthetic`` (the long-tailed
length corpus of :mod:`resihp_core.predictor.corpus` with random token ids) and
``text`` (local text / JSONL files, byte-level tokens). See docs/data.md.

Torch-free; numpy is imported only when a source computes.
"""

from __future__ import annotations

from resihp_core.data.registry import DataSourceFactory, DataSourceRegistry, SourceEntry, create_source
from resihp_core.data.source import DataError, DataSource, SourceContext, Workload

__all__ = [
    "DataError",
    "DataSource",
    "DataSourceFactory",
    "DataSourceRegistry",
    "SourceContext",
    "SourceEntry",
    "Workload",
    "create_source",
]
