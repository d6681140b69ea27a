"""The job description every worker reads: written once as JSON by whoever assembles the
job (``resihp run``, the conformance kit, a test), passed to workers as ``RESIHP_JOB``.

It is framework-neutral. What a framework needs (model shape, optimizer, dtype) is the
adapter's own opaque section, ``adapter_config``, which only the adapter validates; the
data source has its own section, ``data``. See ``docs/worker-protocol.md``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["JobSpec", "JobSpecError"]


class JobSpecError(ValueError):
    """A malformed job description; the message names the field."""


@dataclass(frozen=True)
class JobSpec:
    """Everything a worker needs besides the plan.

    :param adapter: the registered adapter's name (``resihp plugins`` lists them).
    :param adapter_config: the adapter's own section, opaque to the core.
    :param data: the data source section, ``{"source": NAME, ...options}``.
    :param dp: data shards of the global batch (replicas of the initial plan); the
        global batch is ``dp x num_microbatches`` micro-batches whatever the plan.
    :param checkpoint_every: write a checkpoint after every this many committed
        iterations (0: never), and after the last; ``checkpoint_dir`` is where.
    :param checkpoint_keep: retention, the newest complete checkpoints kept (0: all).
    :param memory_copy_every: every this many committed iterations, each rank's state
        is also held in a peer's memory on another node (0: never; adapters with the
        ``memory_copy`` capability), which a restore reads before any checkpoint file.
    :param dump_dir: at the job's end each worker saves what it holds there (tests).
    :param faults: injected faults (``resihp_core.faults.Fault`` dicts).
    """

    adapter: str = ""
    adapter_config: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=lambda: {"source": "synthetic"})
    dp: int = 2
    num_microbatches: int = 4
    seed: int = 0
    timeout_s: float = 10.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 0
    memory_copy_every: int = 0
    dump_dir: str | None = None
    faults: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.adapter, str) or not self.adapter:
            raise JobSpecError(f"job.adapter must name an adapter (resihp plugins lists them), got {self.adapter!r}")
        for name in ("adapter_config", "data"):
            if not isinstance(getattr(self, name), dict):
                raise JobSpecError(f"job.{name} must be a table/object")
        for name in ("dp", "num_microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise JobSpecError(f"job.{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise JobSpecError(f"job.checkpoint_every must be an integer >= 0, got {self.checkpoint_every!r}")
        if not isinstance(self.checkpoint_keep, int) or self.checkpoint_keep < 0 or self.checkpoint_keep == 1:
            raise JobSpecError(f"job.checkpoint_keep must be 0 (keep all) or >= 2, got {self.checkpoint_keep!r}")
        if not isinstance(self.memory_copy_every, int) or isinstance(self.memory_copy_every, bool) \
                or self.memory_copy_every < 0:
            raise JobSpecError(f"job.memory_copy_every must be an integer >= 0, got {self.memory_copy_every!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise JobSpecError("job.checkpoint_every needs job.checkpoint_dir")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise JobSpecError(f"job.timeout_s must be > 0, got {self.timeout_s!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise JobSpecError(f"job description is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise JobSpecError("job description must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise JobSpecError(f"job description: unknown field(s) {unknown} (known: {sorted(known)})")
        return cls(**data)
