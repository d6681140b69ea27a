"""Fault injection: one API, ``fail_at(device, iteration, kind)``, and scenario files.

Kinds (docs/design.md §7):

- ``kill``: SIGKILL the worker (fail-stop);
- ``stop``: SIGSTOP the worker (a hang: alive, no progress);
- ``slow``: compute fail-slow by ``factor`` (every compute chunk takes ``factor`` x longer);
- ``comm``: communication fail-slow: every transfer the device takes part in is
  delayed by ``delay_s`` seconds;
- ``contend``: CPU contention: a busy process competes with the worker for its core;
- ``ecc`` / ``nccl``: the worker raises what a GPU job sees of a failing device (CUDA's
  uncorrectable ECC error, an NCCL ``DistBackendError``): a device-kind exception, so the
  device is lost and the job goes on (docs/errors.md);
- ``repair``: the device is repaired: once ``iteration`` iterations are committed its
  worker is started again and the Scheduler brings it back (after a ``kill``);
- ``flip``: silent data corruption: bit ``bit`` of the first element of the device's
  first (by name) tensor of ``target`` (``grad``: the reduced gradient just before the
  optimizer step, ``param``: a parameter or ``optimizer``: an optimizer-state tensor
  just after it) is flipped in ``iteration``; with ``repeat`` in that iteration and
  every later one (a bad device). The adapter applies it (docs/sdc.md).

Severities ``weak`` / ``medium`` / ``strong`` are defined by the throughput loss they
cause unmitigated, about 35 % / 55 % / 70 %: a slowdown factor of 1/(1 - loss), i.e.
1.54 / 2.22 / 3.33 for the device's compute.

Workers read the faults meant for them from their job description and inject them
themselves at the start of the given iteration, so injection is exact in iteration and
independent of the launcher. Repairs are the runtime's business (:func:`repairs`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["Fault", "FaultError", "KINDS", "TARGETS", "SEVERITY_LOSS", "fail_at", "severity_factor", "load_scenario",
           "repairs", "worker_faults"]

KINDS = ("kill", "stop", "slow", "comm", "contend", "repair", "ecc", "nccl", "flip")
TARGETS = ("grad", "param", "optimizer")
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
    target: str = "grad"  # flip: which state is corrupted
    bit: int = 20  # flip: which bit of the element (taken modulo the element's width)
    repeat: bool = False  # flip: every iteration from ``iteration`` on (a bad device)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise FaultError(f'"kind" = {self.kind!r}: not one of {", ".join(KINDS)}')
        for name in ("device", "iteration"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise FaultError(f'"{name}" = {v!r}: expected an integer')
            if v < 0:
                raise FaultError(f'"{name}" = {v!r}: must be >= 0')
        for name in ("factor", "delay_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise FaultError(f'"{name}" = {v!r}: expected a finite number')
        if self.kind == "slow" and not self.factor > 1.0:
            raise FaultError(f'"factor" = {self.factor!r}: factor must be > 1 for a slow fault')
        if self.kind == "comm" and not self.delay_s > 0:
            raise FaultError(f'"delay_s" = {self.delay_s!r}: delay_s must be > 0 for a comm fault')
        if self.target not in TARGETS:
            raise FaultError(f'"target" = {self.target!r}: not one of {", ".join(TARGETS)}')
        if isinstance(self.bit, bool) or not isinstance(self.bit, int) or not 0 <= self.bit < 64:
            raise FaultError(f'"bit" = {self.bit!r}: expected an integer in 0-63')
        if not isinstance(self.repeat, bool):
            raise FaultError(f'"repeat" = {self.repeat!r}: expected true or false')

    def to_dict(self) -> dict:
        return asdict(self)


def fail_at(device: int, iteration: int, kind: str, *, factor: float | None = None,
            severity: str | None = None, delay_s: float = 0.0, target: str = "grad", bit: int = 20,
            repeat: bool = False) -> Fault:
    """The one fault-injection API: ``kind`` happens to ``device`` when it starts
    ``iteration``. ``severity`` (weak/medium/strong) sets ``factor`` for slow faults;
    ``target``, ``bit`` and ``repeat`` describe a ``flip``."""
    if severity is not None:
        factor = severity_factor(severity)
    return Fault(device, iteration, kind, factor if factor is not None else 1.0, delay_s, target, bit, repeat)


def _typed(e: dict, name: str, kinds: tuple[type, ...], what: str, default: object = None) -> object:
    if name in e and e[name] is None:
        raise FaultError(f'"{name}" = null: expected {what}')
    v = e.get(name, default)
    if v is not None and (isinstance(v, bool) or not isinstance(v, kinds)):
        raise FaultError(f'"{name}" = {v!r}: expected {what}')
    return v


def load_scenario(path: str | Path | Iterable[dict], *, devices: Iterable[int] | None = None,
                  iterations: int | None = None) -> list[Fault]:
    """Faults from a JSON file (a list of objects with ``device``, ``iteration``,
    ``kind`` and optionally ``severity``/``factor``/``delay_s``) or from such a list.

    Every field is checked with a message naming the entry and the field; with
    ``devices`` (the job's device ids) and ``iterations`` (the job's length) a fault
    on a device the job does not have, or at an iteration it never reaches, is refused.
    """
    if isinstance(path, (str, Path)):
        try:
            entries = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise FaultError(f"cannot read scenario {path}: {e}") from None
    else:
        entries = list(path)
    if not isinstance(entries, list):
        raise FaultError("a scenario is a JSON list of faults")
    known = None if devices is None else set(devices)
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise FaultError(f"scenario entry {i} is not an object")
        unknown = set(e) - {"device", "iteration", "kind", "severity", "factor", "delay_s", "target", "bit", "repeat"}
        if unknown:
            raise FaultError(f"scenario entry {i}: unknown field(s) {sorted(unknown)}")
        try:
            missing = [k for k in ("device", "iteration", "kind") if k not in e]
            if missing:
                raise FaultError(f"missing field '{missing[0]}'")
            device = _typed(e, "device", (int,), "an integer device id")
            iteration = _typed(e, "iteration", (int,), "an integer iteration")
            kind = _typed(e, "kind", (str,), f"one of {', '.join(KINDS)}")
            severity = _typed(e, "severity", (str,), f"one of {', '.join(SEVERITY_LOSS)}")
            factor = _typed(e, "factor", (int, float), "a number")
            delay_s = _typed(e, "delay_s", (int, float), "a number", 0.0)
            target = _typed(e, "target", (str,), f"one of {', '.join(TARGETS)}", "grad")
            bit = _typed(e, "bit", (int,), "an integer bit index", 20)
            repeat = e.get("repeat", False)
            if not isinstance(repeat, bool):
                raise FaultError(f'"repeat" = {repeat!r}: expected true or false')
            if severity is not None and factor is not None:
                raise FaultError('give "severity" or "factor", not both')
            if severity is not None and severity not in SEVERITY_LOSS:
                raise FaultError(f'"severity" = {severity!r}: not one of {", ".join(SEVERITY_LOSS)}')
            fault = fail_at(device, iteration, kind, factor=None if factor is None else float(factor),  # type: ignore[arg-type]
                            severity=severity, delay_s=float(delay_s), target=target,  # type: ignore[arg-type]
                            bit=bit, repeat=repeat)  # type: ignore[arg-type]
            if known is not None and fault.device not in known:
                raise FaultError(f'"device" = {fault.device}: not a device of the job '
                                 f'(devices {_ranges(sorted(known))})')
            if iterations is not None and fault.iteration >= iterations:
                raise FaultError(f'"iteration" = {fault.iteration}: the job runs iterations 0-{iterations - 1}')
            out.append(fault)
        except FaultError as fe:
            raise FaultError(f"scenario entry {i}: {fe}") from None
    return out


def _ranges(ids: list[int]) -> str:
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


def worker_faults(faults: Iterable[Fault]) -> list[dict]:
    """The faults workers inject themselves, for their job description."""
    return [f.to_dict() for f in faults if f.kind != "repair"]


def repairs(faults: Iterable[Fault]) -> dict[int, tuple[int, ...]]:
    """Iteration -> devices repaired then (``ResilientConfig.repairs``)."""
    out: dict[int, tuple[int, ...]] = {}
    for f in faults:
        if f.kind == "repair":
            out[f.iteration] = tuple(sorted({*out.get(f.iteration, ()), f.device}))
    return out
