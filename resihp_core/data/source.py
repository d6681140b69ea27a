"""The data-source contract: which documents make up every micro-batch of a job.

A :class:`DataSource` answers two questions for any ``(iteration, replica, mb)``,
the same on every process and without reading the data stream in order:

* :meth:`DataSource.lengths` — the document lengths of that packed micro-batch. It is
  cheap: the controller's predictor and the Scheduler ask it for whole iterations;
* :meth:`DataSource.tokens` — the token ids, ``sum(lengths)`` of them.

Because any rank can rebuild any micro-batch, work migrated to another replica needs
no data movement, and a fault-free reference run sees exactly the same batches.
Every micro-batch holds exactly ``token_budget`` tokens (N); a document that does not
fit is split, its tail opening the next micro-batch (see docs/data.md).

This module is torch-free and imports numpy only inside the methods that need it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from resihp_core.config import ConfigError

__all__ = ["DataError", "DataSource", "SourceContext", "Workload"]

#: (replica, micro-batch) -> document lengths of that packed micro-batch; the same
#: shape as :data:`resihp_core.predictor.corpus.Workload`.
Workload = dict[tuple[int, int], tuple[int, ...]]


class DataError(ConfigError):
    """Bad data configuration or unreadable data; ``path`` names the field
    (``data.paths``) and the message says what to change."""

    def __init__(self, problem: str, *, field: str | None = None, path: str | None = None,
                 **value: Any) -> None:
        # ``value=...`` is optional and may legitimately be None, hence **value.
        super().__init__(problem, path=path or (f"data.{field}" if field else None), **value)


@dataclass(frozen=True)
class SourceContext:
    """What the job tells every source besides its own options.

    ``dp`` x ``num_microbatches`` micro-batches make one iteration's global batch;
    ``seed`` fixes document order and synthetic token ids; ``token_budget`` (N, from
    ``training.token_budget``) and ``vocab_size`` (the model's vocabulary, from
    ``model.vocab``) are None when the caller does not know them.
    """

    dp: int
    num_microbatches: int
    seed: int = 0
    token_budget: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        for name, lo in (("dp", 1), ("num_microbatches", 1), ("seed", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise DataError(f"{name} must be an int >= {lo}, got {v!r}")
        for name in ("token_budget", "vocab_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise DataError(f"{name} must be an int >= 1, got {v!r}")


class DataSource(abc.ABC):
    """Deterministic, addressable training data (see the module docstring).

    Subclasses set :attr:`vocab_size`, :attr:`token_budget`, :attr:`dp`,
    :attr:`num_microbatches` and implement :meth:`lengths`, :meth:`tokens` and
    :meth:`spec`. Sources are built by :func:`resihp_core.data.create_source` from the
    configuration's ``[data]`` section.
    """

    name: ClassVar[str] = ""
    vocab_size: int
    token_budget: int
    dp: int
    num_microbatches: int

    @abc.abstractmethod
    def lengths(self, iteration: int, replica: int, mb: int) -> tuple[int, ...]:
        """Document lengths of micro-batch ``mb`` of ``replica`` in ``iteration``; they
        sum to :attr:`token_budget`."""

    @abc.abstractmethod
    def tokens(self, iteration: int, replica: int, mb: int) -> Any:
        """Token ids of that micro-batch: a numpy int64 array of ``sum(lengths)``
        values in ``[0, vocab_size)``."""

    @abc.abstractmethod
    def spec(self) -> dict[str, Any]:
        """The ``[data]`` section that rebuilds exactly this source on another process
        (paths resolved, defaults filled in, a corpus fingerprint where it applies)."""

    def check_address(self, iteration: int, replica: int, mb: int) -> None:
        """Raise IndexError unless ``(iteration, replica, mb)`` is in the job's batch."""
        if not (isinstance(iteration, int) and iteration >= 0):
            raise IndexError(f"iteration must be an int >= 0, got {iteration!r}")
        if not 0 <= replica < self.dp:
            raise IndexError(f"replica {replica} is outside the {self.dp} data shards")
        if not 0 <= mb < self.num_microbatches:
            raise IndexError(f"micro-batch {mb} is outside 0..{self.num_microbatches - 1}")

    def workload(self, iteration: int, dp: int | None = None,
                 num_microbatches: int | None = None) -> Workload:
        """Every micro-batch of ``iteration``: ``(replica, mb) -> lengths`` (what the
        predictor and the Scheduler consume). ``dp`` / ``num_microbatches`` default to
        the source's and must equal them: the global batch is split once, per job."""
        for name, given, mine in (("dp", dp, self.dp), ("num_microbatches", num_microbatches,
                                                         self.num_microbatches)):
            if given is not None and given != mine:
                raise DataError(f"this source was built for {name}={mine}, asked for {given}")
        return {(r, j): self.lengths(iteration, r, j)
                for r in range(self.dp) for j in range(self.num_microbatches)}

    def label_count(self, iteration: int) -> int:
        """Labelled tokens of the whole global batch of ``iteration`` (every token but
        the last of each document piece): the divisor of the mean loss."""
        return sum(sum(ls) - len(ls) for ls in self.workload(iteration).values())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, N={self.token_budget}, "
                f"vocab={self.vocab_size}, dp={self.dp}, m={self.num_microbatches})")


def option(options: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any, *,
           minimum: int | None = None) -> Any:
    """``options[name]`` checked against ``kind`` (bool is not an int), else ``default``."""
    if name not in options:
        return default
    v = options[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise DataError(f"must be {names}, got {type(v).__name__}", field=name, value=v)
    if minimum is not None and v < minimum:
        raise DataError(f"must be >= {minimum}", field=name, value=v)
    return v


def check_known(options: Mapping[str, Any], known: set[str], source: str) -> None:
    """Reject options a source does not take, with a close-match suggestion."""
    import difflib

    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DataError(f"unknown option of the {source!r} data source{hint}; it takes: "
                            f"{', '.join(sorted(known))}", field=str(key))


def resolve_budget(options: Mapping[str, Any], ctx: SourceContext, default: int | None) -> int:
    """N: ``training.token_budget`` (``ctx``), or the section's ``token_budget`` (a spec
    written by :meth:`DataSource.spec`); both given must agree."""
    own = option(options, "token_budget", int, None, minimum=1)
    if own is not None and ctx.token_budget is not None and own != ctx.token_budget:
        raise DataError(f"conflicts with training.token_budget = {ctx.token_budget}",
                        field="token_budget", value=own)
    n = ctx.token_budget if ctx.token_budget is not None else own
    if n is None:
        n = default
    if n is None:
        raise DataError("the token budget is unknown: set training.token_budget", field="token_budget")
    return n
