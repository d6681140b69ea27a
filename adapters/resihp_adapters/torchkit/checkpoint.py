"""Checkpoint I/O every torch adapter can use: one verified file per component and
completed iteration (atomic write, SHA-256 sidecar), and the newest complete checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import Tensor

__all__ = ["CheckpointError", "save_component", "load_component", "latest_complete_checkpoint",
           "write_json_atomic"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def _component_path(root: Path, iteration: int, component: str) -> Path:
    return root / f"iter{iteration:08d}" / f"{component}.pt"


def save_component(root: str | os.PathLike, iteration: int, component: str,
                   full: Mapping[str, tuple[Tensor, Tensor, Tensor]]) -> Path:
    """Atomically write the full (unsharded) state of one component after ``iteration``
    completed: temp file, fsync, rename; a sidecar holds its SHA-256 for verification."""
    path = _component_path(Path(root), iteration, component)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({k: [t.detach().cpu() for t in v] for k, v in full.items()}, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    for target, payload in ((path, data), (path.with_suffix(".sha256"), digest.encode())):
        tmp = target.with_suffix(target.suffix + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    return path


def load_component(root: str | os.PathLike, iteration: int, component: str) -> dict[str, list[Tensor]]:
    """Read and verify one component; raises :class:`CheckpointError` naming the file."""
    path = _component_path(Path(root), iteration, component)
    side = path.with_suffix(".sha256")
    if not path.exists() or not side.exists():
        raise CheckpointError(f"checkpoint file {path} (or its .sha256) is missing")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != side.read_text().strip():
        raise CheckpointError(f"checkpoint file {path} is corrupt (SHA-256 mismatch)")
    return torch.load(io.BytesIO(data), weights_only=True)


def latest_complete_checkpoint(root: str | os.PathLike, components: Iterable[str]) -> int | None:
    """The newest iteration whose every component file exists and verifies, or None."""
    root = Path(root)
    comps = list(components)
    if not root.exists():
        return None
    iters = sorted((int(p.name[4:]) for p in root.glob("iter*") if p.name[4:].isdigit()), reverse=True)
    for it in iters:
        try:
            for c in comps:
                load_component(root, it, c)
        except CheckpointError:
            continue
        return it
    return None


def write_json_atomic(path: Path, obj: object) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
