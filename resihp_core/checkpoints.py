"""The checkpoint contract every adapter keeps: the core owns the layout on disk (a folder
per iteration, a manifest, SHA-256s, completeness, retention) and picks the checkpoint
a restore or a resume uses; an adapter writes files of its own format *inside* the
iteration's folder and lists them in the manifest (``docs/checkpoints.md``).

Framework-neutral (hashlib, json and os only)::

    <root>/iter<NNNNNNNN>/manifest.json     written last: the checkpoint's seal
    <root>/iter<NNNNNNNN>/...               the adapter's own files and folders

The manifest names what the checkpoint holds in either or both of two ways:

- ``"files": {"relative/path": "<sha256 hex>", ...}``: any files below the folder (a
  DCP folder, per-layer files), hashed by the one writer that seals the checkpoint
  (:func:`seal`) once every writer has finished (after a barrier);
- ``"components": [names]``: one ``<name>.pt`` per component with its SHA-256 in a
  ``<name>.sha256`` sidecar, each file written and hashed by its own writer (the
  writers of ``resihp_adapters.torchkit.checkpoint``, each writing the same manifest).

A checkpoint is *complete* when its manifest exists, names something, and every file
it names is present with the SHA-256 it says. Anything else (a writer died mid-write,
a disk error, a flipped byte) is incomplete, and restores fall back to an older
complete one (:func:`restore_point`, the one rule the supervisor, ``--resume`` and the
conformance kit use).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["CheckpointInfo", "iteration_dir", "scan", "verify", "newest_complete", "prune", "seal",
           "file_sha256", "restore_point"]

MANIFEST = "manifest.json"
_TMP = ".tmp"  # files whose name contains this are unfinished writes, never sealed


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


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of a file, read in 1 MiB blocks (checkpoint files can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _inside(d: Path, rel: str) -> Path | None:
    """``d / rel`` if ``rel`` is a plain relative path that stays inside ``d``."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return None
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or rel == MANIFEST:
        return None
    return d.joinpath(*parts)


def verify(root: str | Path, iteration: int) -> CheckpointInfo:
    """Check checkpoint ``iteration``: its manifest and every file it names, with its SHA-256."""
    d = iteration_dir(root, iteration)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        comps = manifest.get("components", [])
        files = manifest.get("files", {})
        if not isinstance(comps, list) or not isinstance(files, dict):
            return CheckpointInfo(iteration, f"{d / MANIFEST} is malformed")
        if not comps and not files:
            return CheckpointInfo(iteration, f"{d / MANIFEST} names no components or files")
        if manifest.get("iteration", iteration) != iteration:
            return CheckpointInfo(iteration, f"{d / MANIFEST} is for iteration {manifest.get('iteration')}")
    except FileNotFoundError:
        return CheckpointInfo(iteration, f"{d / MANIFEST} is missing (a writer did not finish)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return CheckpointInfo(iteration, f"{d / MANIFEST} is unreadable ({type(e).__name__})")
    for c in comps:
        f, side = d / f"{c}.pt", d / f"{c}.sha256"
        try:
            want = side.read_text().strip()
            got = file_sha256(f)
        except OSError:
            return CheckpointInfo(iteration, f"{f} (or its .sha256) is missing")
        if got != want:
            return CheckpointInfo(iteration, f"{f} is corrupt (SHA-256 mismatch)")
    for rel, want in sorted(files.items()):
        f = _inside(d, rel)
        if f is None:
            return CheckpointInfo(iteration, f"{d / MANIFEST} names {rel!r}, not a path inside the checkpoint")
        try:
            got = file_sha256(f)
        except OSError:
            return CheckpointInfo(iteration, f"{f} is missing")
        if got != want:
            return CheckpointInfo(iteration, f"{f} is corrupt (SHA-256 mismatch)")
    return CheckpointInfo(iteration)


def seal(root: str | Path, iteration: int, files: Iterable[str] | None = None) -> dict[str, str]:
    """Complete checkpoint ``iteration``: hash ``files`` (paths relative to its folder;
    None: every file below it except unfinished ``*.tmp*`` writes) and write the
    manifest listing them, atomically (temporary file, fsync, rename). Call it once,
    from one writer, after every writer of the checkpoint has finished (a barrier).
    Returns ``{path: sha256}``; raises ``OSError`` on a storage error and
    ``ValueError`` if there is nothing to seal."""
    d = iteration_dir(root, iteration)
    if files is None:
        files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*")
                       if p.is_file() and p.name != MANIFEST and _TMP not in p.name)
    digests = {}
    for rel in files:
        f = _inside(d, rel)
        if f is None:
            raise ValueError(f"checkpoint file {rel!r} is not a path inside {d}")
        digests[rel] = file_sha256(f)
    if not digests:
        raise ValueError(f"checkpoint {d} has no files to seal")
    payload = json.dumps({"iteration": iteration, "files": digests}, sort_keys=True).encode()
    tmp = d / f"{MANIFEST}{_TMP}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / MANIFEST)
    finally:
        tmp.unlink(missing_ok=True)
    _remember_complete(d)
    return digests


#: Checkpoints this process hashed and found complete (sealed them, or verified them for
#: retention), by folder: the size, modification time and inode of every file in it
#: then. Retention runs at every seal and counts the ``keep`` newest complete ones; hashing
#: them all again each time cost more CPU than the write itself on a 2-core host (three
#: checkpoints of 149 MB per seal). A folder whose files all still look the same is not
#: hashed again for retention; a restore always hashes (:func:`verify`).
_COMPLETE: dict[str, tuple[tuple[str, int, int, int], ...]] = {}


def _look(d: Path) -> tuple[tuple[str, int, int, int], ...] | None:
    try:
        out = []
        for p in sorted(d.rglob("*")):
            if p.is_file():
                st = p.stat()
                out.append((p.relative_to(d).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(out)
    except OSError:
        return None


def _remember_complete(d: Path) -> None:
    look = _look(d)
    if look is not None:
        _COMPLETE[str(d)] = look


def _complete_for_retention(root: Path, iteration: int) -> bool:
    d = iteration_dir(root, iteration)
    before = _look(d)
    if before is not None and _COMPLETE.get(str(d)) == before:
        return True
    if not verify(root, iteration).complete:
        _COMPLETE.pop(str(d), None)
        return False
    if before is not None and _look(d) == before:  # unchanged while it was hashed
        _COMPLETE[str(d)] = before
    return True


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
    Returns the iterations deleted. A checkpoint this process already hashed whole and
    whose files look unchanged (size, time, inode) is not hashed again."""
    if keep <= 0:
        return []
    root = Path(root)
    complete = 0
    deleted = []
    for it in _iterations(root):
        if complete >= keep:
            shutil.rmtree(iteration_dir(root, it), ignore_errors=True)
            _COMPLETE.pop(str(iteration_dir(root, it)), None)
            deleted.append(it)
        elif _complete_for_retention(root, it):
            complete += 1
    return deleted


def restore_point(root: str | Path | None, resume: int, every: int, *, grace_s: float = 3.0,
                  ) -> tuple[int | None, list[CheckpointInfo]]:
    """The checkpoint a restore of a job whose first uncommitted iteration is ``resume``
    loads: the newest complete one of an iteration ``< resume`` (None: none, start from
    the seed), and the newer ones skipped because they are not complete. If the one due
    last by the interval ``every`` is not complete yet (a writer still at work), wait up
    to ``grace_s`` for it. The supervisor and the conformance kit both use this rule.

    ``root`` None: the job keeps no checkpoints, and each survivor holds the state of
    the last committed iteration (``resume - 1``)."""
    if root is None:
        return resume - 1, []
    if resume <= 0:
        return None, []
    deadline = time.monotonic() + (grace_s if every else 0.0)
    step = max(1, every)
    due = (resume // step) * step - 1  # the newest committed iteration due a checkpoint
    while True:
        it, skipped = newest_complete(root, at_most=resume - 1)
        if (-1 if it is None else it) >= due or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return it, skipped
