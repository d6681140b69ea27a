"""Checkpoint I/O every torch adapter can use: one verified file per component and
completed iteration (atomic write, SHA-256 sidecar), a manifest naming every component
of the model, and :class:`CheckpointWriter`, which writes on a background thread so a
checkpoint does not stall an iteration. The folder layout and what "complete" means
are in :mod:`resihp_core.checkpoints` (``docs/checkpoints.md``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from resihp_core import checkpoints as catalogue

__all__ = ["CheckpointError", "CheckpointWriter", "WriteResult", "save_component", "load_component",
           "latest_complete_checkpoint", "write_manifest", "write_json_atomic"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def _component_path(root: Path, iteration: int, component: str) -> Path:
    return catalogue.iteration_dir(root, iteration) / f"{component}.pt"


def _write_atomic(target: Path, payload: bytes) -> None:
    tmp = target.with_suffix(target.suffix + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def save_component(root: str | os.PathLike, iteration: int, component: str,
                   full: Mapping[str, Sequence[Tensor]]) -> int:
    """Atomically write the full (unsharded) state of one component after ``iteration``
    completed: temp file, fsync, rename; then a sidecar with its SHA-256, read back and
    verified. Returns the bytes written."""
    path = _component_path(Path(root), iteration, component)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({k: [t.detach().cpu() for t in v] for k, v in full.items()}, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    _write_atomic(path, data)
    _write_atomic(path.with_suffix(".sha256"), digest.encode())
    if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
        raise CheckpointError(f"checkpoint file {path} does not read back as written")
    return len(data)


def write_manifest(root: str | os.PathLike, iteration: int, components: Iterable[str]) -> None:
    """Name every component a complete checkpoint of ``iteration`` has (each writer
    writes the same manifest; the last rename wins)."""
    d = catalogue.iteration_dir(root, iteration)
    d.mkdir(parents=True, exist_ok=True)
    _write_atomic(d / catalogue.MANIFEST, json.dumps({"iteration": iteration,
                                                       "components": sorted(components)}).encode())


def load_component(root: str | os.PathLike, iteration: int, component: str) -> dict[str, list[Tensor]]:
    """Read and verify one component; raises :class:`CheckpointError` naming the file."""
    path = _component_path(Path(root), iteration, component)
    side = path.with_suffix(".sha256")
    try:
        data, want = path.read_bytes(), side.read_text().strip()
    except OSError:
        raise CheckpointError(f"checkpoint file {path} (or its .sha256) is missing") from None
    if hashlib.sha256(data).hexdigest() != want:
        raise CheckpointError(f"checkpoint file {path} is corrupt (SHA-256 mismatch)")
    return torch.load(io.BytesIO(data), weights_only=True)


def latest_complete_checkpoint(root: str | os.PathLike, components: Iterable[str] = ()) -> int | None:
    """The newest complete checkpoint (manifest and every file verified), or None."""
    return catalogue.newest_complete(root)[0]


def write_json_atomic(path: Path, obj: object) -> None:
    _write_atomic(path, json.dumps(obj).encode())


@dataclass(frozen=True)
class WriteResult:
    """What one queued checkpoint write did on this worker."""

    iteration: int
    error: str | None  # None: every file of this worker written and verified
    bytes: int
    seconds: float
    pruned: tuple[int, ...] = ()


class CheckpointWriter:
    """One background thread per worker that writes queued checkpoints in order.

    :meth:`submit` takes tensors the caller has already copied (the iteration goes on
    changing the live ones), so the training thread only pays for the copy. At most
    one write is in flight: if the previous one is still running when the next is due
    (a disk slower than the interval), ``submit`` waits for it, so every writer writes
    every due checkpoint and memory stays bounded; past ``busy_timeout_s`` (a hung
    mount) the new checkpoint is given up and reported instead. A write
    that fails (read-only folder, full disk) becomes a :class:`WriteResult` with the
    error, never an exception in training: the next interval simply tries again.
    After a successful write, checkpoints beyond the newest ``keep`` complete ones are
    deleted (retention).
    """

    def __init__(self, root: str | os.PathLike, keep: int = 0, busy_timeout_s: float = 120.0) -> None:
        self.root, self.keep, self.busy_timeout_s = Path(root), keep, busy_timeout_s
        self.waited_s = 0.0  # time submit spent waiting for the previous write
        self._q: queue.Queue = queue.Queue()
        self._results: list[WriteResult] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        threading.Thread(target=self._run, daemon=True, name="resihp-checkpoint-writer").start()

    def submit(self, iteration: int, components: Mapping[str, Mapping[str, Sequence[Tensor]]],
               manifest: Iterable[str]) -> None:
        t0 = time.perf_counter()
        idle = self._idle.wait(self.busy_timeout_s)
        self.waited_s += time.perf_counter() - t0
        if not idle:
            with self._lock:
                self._results.append(WriteResult(iteration, f"the previous checkpoint write is still running after "
                                                            f"{self.busy_timeout_s:.0f} s", 0, 0.0))
            return
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put((iteration, components, sorted(manifest)))

    def results(self) -> list[WriteResult]:
        """Writes finished since the last call."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def drain(self, timeout: float = 120.0) -> bool:
        """Wait until every queued write finished; False on time-out."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            iteration, comps, manifest = self._q.get()
            t0 = time.perf_counter()
            nbytes, error, pruned = 0, None, ()
            try:
                for comp, tensors in comps.items():
                    nbytes += save_component(self.root, iteration, comp, tensors)
                write_manifest(self.root, iteration, manifest)
                pruned = tuple(catalogue.prune(self.root, self.keep))
            except Exception as e:  # noqa: BLE001 - any storage error is reported, not raised
                error = f"{type(e).__name__}: {e}"
            res = WriteResult(iteration, error, nbytes, time.perf_counter() - t0, pruned)
            with self._lock:
                self._results.append(res)
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()
