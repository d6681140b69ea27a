"""Built-in data sources (``synthetic``, ``text``), registered ``trylast`` so a plugin
can replace either by registering the same name. Listed in
:data:`resihp_core.plugins.BUILTINS`; registering imports no numpy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from resihp_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from resihp_core.data import DataSource, DataSourceRegistry, SourceContext


def _synthetic(options: Mapping[str, Any], ctx: SourceContext) -> DataSource:
    from resihp_core.data.synthetic import make_synthetic

    return make_synthetic(options, ctx)


def _text(options: Mapping[str, Any], ctx: SourceContext) -> DataSource:
    from resihp_core.data.text import make_text

    return make_text(options, ctx)


@hookimpl(trylast=True)
def resihp_register_data_sources(registry: DataSourceRegistry) -> None:
    registry.register("synthetic", _synthetic,
                      description="long-tailed synthetic document lengths, random token ids")
    registry.register("text", _text,
                      description="local text / JSONL files, byte-level tokens, packed to N tokens")
