"""The checkpoint folder as the controller sees it: which checkpoints are complete, which
one a restore or a resume uses, and which old ones retention deletes.

Framework-neutral (hashlib and json only). The layout, written by the adapters'
checkpoint writers (``resihp_adapters.torchkit.checkpoint``), is described in
``docs/checkpoints.md``::

    <root>/iter<NNNNNNNN>/manifest.json     {"iteration": N, "components": [names]}
    <root>/iter<NNNNNNNN>/<component>.pt    one file per component (any format)
    <root>/iter<NNNNNNNN>/<component>.sha256  its SHA-256 (hex)

A checkpoint is *complete* when its manifest exists and every component it names has a
file whose SHA-256 matches its sidecar. Anything else (a writer died mid-write, a disk
error, a flipped byte) is incomplete, and restores fall back to an older complete one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CheckpointInfo", "iteration_dir", "scan", "verify", "newest_complete", "prune"]

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``iter*`` folder: its iteration and, if it is not complete, why."""

    iteration: int
    problem: str | None = None  # None: complete

    @property
    def complete(self) -> bool:
        return self.problem is None


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter{iteration:08d}"


def _iterations(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted((int(p.name[4:]) for p in root.iterdir() if p.name.startswith("iter") and p.name[4:].isdigit()),
                  reverse=True)


def verify(root: str | Path, iteration: int) -> CheckpointInfo:
    """Check checkpoint ``iteration``: manifest, every component file and its SHA-256."""
    d = iteration_dir(root, iteration)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        comps = manifest["components"]
        if not isinstance(comps, list) or not comps:
            return CheckpointInfo(iteration, f"{d / MANIFEST} names no components")
    except FileNotFoundError:
        return CheckpointInfo(iteration, f"{d / MANIFEST} is missing (a writer did not finish)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return CheckpointInfo(iteration, f"{d / MANIFEST} is unreadable ({type(e).__name__})")
    for c in comps:
        f, side = d / f"{c}.pt", d / f"{c}.sha256"
        try:
            data, want = f.read_bytes(), side.read_text().strip()
        except OSError:
            return CheckpointInfo(iteration, f"{f} (or its .sha256) is missing")
        if hashlib.sha256(data).hexdigest() != want:
            return CheckpointInfo(iteration, f"{f} is corrupt (SHA-256 mismatch)")
    return CheckpointInfo(iteration)


def scan(root: str | Path) -> list[CheckpointInfo]:
    """Every checkpoint folder under ``root``, newest first, each verified."""
    return [verify(root, it) for it in _iterations(Path(root))]


def newest_complete(root: str | Path, at_most: int | None = None) -> tuple[int | None, list[CheckpointInfo]]:
    """The newest complete checkpoint of an iteration ``<= at_most`` (None: any), and
    the newer ones skipped because they are not complete (to say so)."""
    skipped = []
    for it in _iterations(Path(root)):
        if at_most is not None and it > at_most:
            continue
        info = verify(root, it)
        if info.complete:
            return it, skipped
        skipped.append(info)
    return None, skipped


def prune(root: str | Path, keep: int) -> list[int]:
    """Retention: keep the ``keep`` newest complete checkpoints and everything newer
    than the oldest of them (in progress); delete older folders. ``keep`` 0 keeps all.
    Returns the iterations deleted."""
    if keep <= 0:
        return []
    root = Path(root)
    complete = 0
    deleted = []
    for it in _iterations(root):
        if complete >= keep:
            shutil.rmtree(iteration_dir(root, it), ignore_errors=True)
            deleted.append(it)
        elif verify(root, it).complete:
            complete += 1
    return deleted
