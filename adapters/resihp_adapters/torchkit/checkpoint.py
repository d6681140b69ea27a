"""Checkpoint I/O every torch adapter can use: one verified file per component and
completed iteration (atomic write, SHA-256 sidecar), a manifest naming every component
of the model, and :class:`CheckpointWriter`, which writes on a background thread so a
checkpoint does not stall an iteration. :class:`SealedWriter` writes the files of a
checkpoint that several ranks write into one folder, in the background, and seals it
(``checkpoints.seal``) only once every writer finished. The folder layout and what
"complete" means are in :mod:`resihp_core.checkpoints` (``docs/checkpoints.md``).
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
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from resihp_core import checkpoints as catalogue
from resihp_core.protocols.checkpoints import CheckpointWrite

__all__ = ["CheckpointError", "CheckpointWriter", "WriteResult", "save_component", "load_component",
           "latest_complete_checkpoint", "write_manifest", "write_json_atomic", "SealedWriter"]


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


# ---------------------------------------------------------------------- sealed writes
#: a writer's "finished" record in the iteration's folder: the files it wrote and their
#: bytes, or its error; the generation keeps an earlier attempt's apart
_WRITTEN = "written-g{generation}-r{rank}.json"


def _save_atomic(target: Path, obj: object) -> int:
    """``torch.save`` ``obj`` to ``target``: temporary file, fsync, rename. Returns the bytes."""
    # Several writers may write the same file (a unit several ranks hold): their own temporaries.
    tmp = target.with_name(f"{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target.stat().st_size


@dataclass
class _Files:
    iteration: int
    root: str  # the job's checkpoint folder
    files: Mapping[str, object]  # path inside the iteration's folder -> what torch.save writes
    generation: int
    rank: int  # among the writers; rank 0 seals
    writers: int
    keep: int
    staged_s: float


class SealedWriter:
    """This rank's background writer of a checkpoint that ``writers`` ranks write into
    one iteration folder, each its own files. The training thread only hands over
    host copies (:meth:`submit`); this thread writes each file (temporary name, fsync,
    rename) and then a small record saying which files it wrote (``written-g<G>-r<R>.json``,
    also on an error). Writer rank 0 then waits, on a thread of its own, for every
    writer's record, seals exactly the files they name (:func:`resihp_core.checkpoints.seal`),
    removes the records and applies retention. A writer that died or a failed write
    leaves the folder unsealed, which the restore rule skips; nothing here touches a
    process group, so a new plan generation never waits for a write.

    One write per rank is in flight at a time: :meth:`wait_idle` (before staging into
    buffers the write in flight may still read) waits for it up to ``busy_timeout_s``;
    the sealer gives up after ``seal_timeout_s``. A checkpoint of an earlier generation
    (``generation``: the rank's current one) that seals late applies no retention: a
    restore may be loading the checkpoint it would delete. Results come back through
    :meth:`results`: a rank's failed write, and the sealer's outcome."""

    def __init__(self, *, busy_timeout_s: float = 120.0, seal_timeout_s: float = 120.0,
                 generation: Callable[[], int] | None = None) -> None:
        self.busy_timeout_s, self.seal_timeout_s = busy_timeout_s, seal_timeout_s
        self.generation = generation
        #: called in the writer thread before a write starts (tests pause or kill a writer here)
        self.before_write: Callable[[int], None] = lambda iteration: None
        self.waited_s = 0.0  # time wait_idle spent waiting for the previous write
        self._q: queue.Queue[_Files] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._results: list[CheckpointWrite] = []
        self._sealers: list[tuple[threading.Thread, int]] = []  # and the generation of its checkpoint
        threading.Thread(target=self._run, daemon=True, name="resihp-sealed-writer").start()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until this rank's write in flight (if any) finished; False past the time-out."""
        t0 = time.perf_counter()
        ok = self._idle.wait(self.busy_timeout_s if timeout is None else timeout)
        self.waited_s += time.perf_counter() - t0
        return ok

    def submit(self, iteration: int, root: str | os.PathLike, files: Mapping[str, object], *, generation: int,
               rank: int, writers: int, keep: int, staged_s: float = 0.0) -> None:
        """Queue this rank's ``files`` of checkpoint ``iteration`` (paths inside its
        folder; objects ``torch.save`` writes, which nothing changes until the write
        finished: :meth:`wait_idle`)."""
        if not 0 <= rank < writers:
            raise ValueError(f"writer rank {rank} is not among the checkpoint's {writers} writers")
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put(_Files(iteration, str(root), dict(files), generation, rank, writers, keep, staged_s))

    def give_up(self, iteration: int, why: str) -> None:
        """Report checkpoint ``iteration`` as not written by this rank (``why``)."""
        with self._lock:
            self._results.append(CheckpointWrite(iteration, why))

    def results(self) -> list[CheckpointWrite]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def drain(self, timeout: float = 120.0) -> bool:
        """Wait until every queued write is written and the newest checkpoint's seal
        finished or gave up (the job's end: its last checkpoint complete before the
        process goes). An older seal still waiting is for a writer that died in an
        earlier generation: the job's end does not wait for it."""
        deadline = time.monotonic() + timeout
        if not self._idle.wait(timeout):
            return False
        # A checkpoint of an earlier generation waits for a writer that may have died
        # with it (a rank killed mid-write): the job's end does not wait for that seal.
        now = self.generation() if self.generation is not None else None
        last = [t for t, g in self._sealers[-1:] if now is None or g >= now]
        for t in last:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in last)

    # ------------------------------------------------------------ the threads
    def _run(self) -> None:
        while True:
            job = self._q.get()
            t0 = time.perf_counter()
            error, written, nbytes = None, [], 0
            try:
                self.before_write(job.iteration)
                folder = catalogue.iteration_dir(job.root, job.iteration)
                for rel, obj in job.files.items():
                    target = folder / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    nbytes += _save_atomic(target, obj)
                    written.append(rel)
            except Exception as e:  # noqa: BLE001 - a storage error is reported, never raised
                error = f"{type(e).__name__}: {e}"
            try:  # the record: the sealer's "finished" (also on an error: then it seals nothing)
                folder = catalogue.iteration_dir(job.root, job.iteration)
                folder.mkdir(parents=True, exist_ok=True)
                write_json_atomic(folder / _WRITTEN.format(generation=job.generation, rank=job.rank),
                                  {"files": written, "bytes": nbytes, "error": error})
            except Exception as e:  # noqa: BLE001 - the sealer then gives up after its time-out
                error = error or f"{type(e).__name__}: {e}"
            if error is not None:
                with self._lock:
                    self._results.append(CheckpointWrite(job.iteration, error, 0, time.perf_counter() - t0))
            elif job.rank == 0:
                t = threading.Thread(target=self._seal, args=(job, t0), daemon=True,
                                     name=f"resihp-seal-{job.iteration}")
                self._sealers = [(s, g) for s, g in self._sealers if s.is_alive()] + [(t, job.generation)]
                t.start()
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def _seal(self, job: _Files, t0: float) -> None:
        """Writer rank 0: every writer's record, then the seal and retention; gives up
        (unsealed) past ``seal_timeout_s`` or when a writer failed."""
        import sys

        folder = catalogue.iteration_dir(job.root, job.iteration)
        names = [folder / _WRITTEN.format(generation=job.generation, rank=r) for r in range(job.writers)]
        deadline = time.monotonic() + self.seal_timeout_s
        while not all(n.exists() for n in names):
            if time.monotonic() > deadline:
                # A writer that died (or was cut off) mid-write: not a storage fault. The
                # checkpoint stays unsealed; the restore rule skips it.
                missing = [r for r, n in enumerate(names) if not n.exists()]
                print(f"time={time.time():.3f} event=checkpoint_unsealed iteration={job.iteration} "
                      f"missing_writers={missing}", file=sys.stderr, flush=True)
                return
            time.sleep(0.01)
        error, total, pruned = None, 0, ()
        try:
            records = [json.loads(n.read_text()) for n in names]
            failed = [(r, rec["error"]) for r, rec in enumerate(records) if rec.get("error")]
            if failed:
                error = ("another writer of this checkpoint failed (" + "; ".join(f"writer {r}: {e}" for r, e in failed)
                         + "); it is left unsealed (incomplete)")
            else:
                files = sorted({f for rec in records for f in rec["files"]})
                catalogue.seal(job.root, job.iteration, files)
                total = sum(int(rec["bytes"]) for rec in records)
                for n in names:
                    n.unlink(missing_ok=True)
                late = self.generation is not None and self.generation() != job.generation
                pruned = () if late else tuple(catalogue.prune(job.root, job.keep))
        except Exception as e:  # noqa: BLE001 - a storage error is reported, never raised
            error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._results.append(CheckpointWrite(job.iteration, error, total,
                                                 job.staged_s + time.perf_counter() - t0, pruned))
