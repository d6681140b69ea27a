"""Named data sources, filled by the ``resihp_register_data_sources`` hook, and
:func:`create_source`, which builds the one a job's ``[data]`` section names."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from resihp_core.adapter import Registry, RegistryError, UnknownNameError
from resihp_core.data.source import DataError, DataSource, SourceContext

if TYPE_CHECKING:
    from resihp_core.plugins import Plugins

__all__ = ["DataSourceFactory", "DataSourceRegistry", "SourceEntry", "create_source"]

#: ``factory(options, ctx) -> DataSource``: ``options`` is the ``[data]`` section
#: without ``source``; the factory validates them (errors name the field).
DataSourceFactory = Callable[[Mapping[str, Any], SourceContext], DataSource]


@dataclass(frozen=True)
class SourceEntry:
    name: str
    factory: DataSourceFactory
    description: str = ""


class DataSourceRegistry(Registry[SourceEntry]):
    """Data sources by name (built in: ``synthetic``, ``text``)."""

    kind = "data source"

    def register(self, name: str, factory: DataSourceFactory, *, description: str = "") -> None:
        if not callable(factory):
            raise RegistryError(f"{self.kind} {name!r}: factory must be callable")
        self._add(name, SourceEntry(name, factory, description))


#: Sources already built in this process, by their canonical section and context: the
#: adapter, the reference run and the controller ask for the same source many times,
#: and a corpus is indexed once per process.
_BUILT: OrderedDict[str, DataSource] = OrderedDict()
_BUILT_MAX = 8


def create_source(
    section: Mapping[str, Any], *, dp: int, num_microbatches: int, seed: int = 0,
    token_budget: int | None = None, vocab_size: int | None = None, plugins: Plugins | None = None,
) -> DataSource:
    """The data source a configuration's ``[data]`` section describes:
    ``{"source": NAME, **options}`` (``source`` defaults to ``synthetic``).

    ``token_budget`` is ``training.token_budget`` and ``vocab_size`` the model's
    vocabulary, when known. The same arguments return the same object within a
    process. Errors are :class:`~resihp_core.data.DataError` naming the field.
    """
    if not isinstance(section, Mapping):
        raise DataError(f"must be a table of settings, got {type(section).__name__}", path="data")
    name = section.get("source", "synthetic")
    if not isinstance(name, str) or not name.strip():
        raise DataError("must be a data source name", field="source", value=name)
    options = {k: v for k, v in section.items() if k != "source"}
    ctx = SourceContext(dp=dp, num_microbatches=num_microbatches, seed=seed,
                        token_budget=token_budget, vocab_size=vocab_size)
    try:
        key = json.dumps([name, options, ctx.__dict__], sort_keys=True)
    except (TypeError, ValueError):
        raise DataError("options must be TOML values (strings, numbers, booleans, lists)",
                        path="data") from None
    if key in _BUILT:
        _BUILT.move_to_end(key)
        return _BUILT[key]
    if plugins is None:
        from resihp_core.plugins import get_plugins

        plugins = get_plugins()
    try:
        entry = plugins.data_sources().get(name)
    except UnknownNameError as e:
        raise DataError(str(e), field="source", value=name) from None
    source = entry.factory(options, ctx)
    if not isinstance(source, DataSource):
        raise DataError(f"the factory of data source {name!r} returned {type(source).__name__}, "
                        "not a DataSource", field="source", value=name)
    _BUILT[key] = source
    while len(_BUILT) > _BUILT_MAX:
        _BUILT.popitem(last=False)
    return source
