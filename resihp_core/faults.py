"""Fault injection: one API, ``fail_at(device, iteration, kind)``, and scenario files.

Kinds (docs/design.md §7):

- ``kill``: SIGKILL the worker (fail-stop);
- ``stop``: SIGSTOP the worker (a hang: alive, no progress);
- ``slow``: compute fail-slow by ``factor`` (every compute chunk takes ``factor`` x longer);
- ``comm``: communication fail-slow: every transfer the device takes part in is
  delayed by ``delay_s`` seconds;
- ``contend``: CPU contention: a busy process competes with the worker for its core;
- ``repair``: the device is repaired: once ``iteration`` iterations are committed its
  worker is started again and the Scheduler brings it back (after a ``kill``).

Severities ``weak`` / ``medium`` / ``strong`` are defined by the throughput loss they
cause unmitigated, about 35 % / 55 % / 70 %: a slowdown factor of 1/(1 - loss), i.e.
1.54 / 2.22 / 3.33 for the device's compute.

Workers read the faults meant for them from their job description and inject them
themselves at the start of the given iteration, so injection is exact in iteration and
independent of the launcher. Repairs are the runtime's business (:func:`repairs`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["Fault", "FaultError", "KINDS", "SEVERITY_LOSS", "fail_at", "severity_factor", "load_scenario",
           "repairs", "worker_faults"]

KINDS = ("kill", "stop", "slow", "comm", "contend", "repair")
SEVERITY_LOSS = {"weak": 0.35, "medium": 0.55, "strong": 0.70}


class FaultError(ValueError):
    """A malformed fault or scenario; the message names the entry and field."""


def severity_factor(severity: str) -> float:
    """Slowdown factor whose unmitigated throughput loss is the severity's."""
    try:
        return 1.0 / (1.0 - SEVERITY_LOSS[severity])
    except KeyError:
        raise FaultError(f"unknown severity {severity!r} (one of {', '.join(SEVERITY_LOSS)})") from None


@dataclass(frozen=True)
class Fault:
    device: int
    iteration: int
    kind: str
    factor: float = 1.0  # slow / contend
    delay_s: float = 0.0  # comm

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FaultError(f"fault kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.device < 0 or self.iteration < 0:
            raise FaultError(f"fault {self.kind}: device and iteration must be >= 0")
        if self.kind == "slow" and not self.factor > 1.0:
            raise FaultError(f"slow fault on device {self.device}: factor must be > 1, got {self.factor}")
        if self.kind == "comm" and not self.delay_s > 0:
            raise FaultError(f"comm fault on device {self.device}: delay_s must be > 0")

    def to_dict(self) -> dict:
        return asdict(self)


def fail_at(device: int, iteration: int, kind: str, *, factor: float | None = None,
            severity: str | None = None, delay_s: float = 0.0) -> Fault:
    """The one fault-injection API: ``kind`` happens to ``device`` when it starts
    ``iteration``. ``severity`` (weak/medium/strong) sets ``factor`` for slow faults."""
    if severity is not None:
        factor = severity_factor(severity)
    return Fault(device, iteration, kind, factor if factor is not None else 1.0, delay_s)


def load_scenario(path: str | Path | Iterable[dict]) -> list[Fault]:
    """Faults from a JSON file (a list of objects with ``device``, ``iteration``,
    ``kind`` and optionally ``severity``/``factor``/``delay_s``) or from such a list."""
    if isinstance(path, (str, Path)):
        try:
            entries = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise FaultError(f"cannot read scenario {path}: {e}") from None
    else:
        entries = list(path)
    if not isinstance(entries, list):
        raise FaultError("a scenario is a JSON list of faults")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise FaultError(f"scenario entry {i} is not an object")
        unknown = set(e) - {"device", "iteration", "kind", "severity", "factor", "delay_s"}
        if unknown:
            raise FaultError(f"scenario entry {i}: unknown field(s) {sorted(unknown)}")
        try:
            out.append(fail_at(int(e["device"]), int(e["iteration"]), str(e["kind"]),
                               factor=e.get("factor"), severity=e.get("severity"),
                               delay_s=float(e.get("delay_s", 0.0))))
        except KeyError as k:
            raise FaultError(f"scenario entry {i}: missing field {k}") from None
        except FaultError as fe:
            raise FaultError(f"scenario entry {i}: {fe}") from None
    return out


def worker_faults(faults: Iterable[Fault]) -> list[dict]:
    """The faults workers inject themselves, for their job description."""
    return [f.to_dict() for f in faults if f.kind != "repair"]


def repairs(faults: Iterable[Fault]) -> dict[int, tuple[int, ...]]:
    """Iteration -> devices repaired then (``run_resilient(repairs=...)``)."""
    out: dict[int, tuple[int, ...]] = {}
    for f in faults:
        if f.kind == "repair":
            out[f.iteration] = tuple(sorted({*out.get(f.iteration, ()), f.device}))
    return out
