"""The checkpoint catalogue (complete / corrupt / in progress, fallback, retention) and
the background writer's storage faults, on real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resihp_core import checkpoints

torch = pytest.importorskip("torch")
from resihp_adapters.torchkit.checkpoint import CheckpointWriter, load_component  # noqa: E402

COMPS = ["embed", "head"]


def _write(root: Path, it: int, comps=COMPS, value: float = 1.0) -> None:
    w = CheckpointWriter(root)
    w.submit(it, {c: {f"{c}.w": (torch.full((3,), value + it),)} for c in comps}, COMPS)
    assert w.drain(30)
    assert [r.error for r in w.results()] == [None]


def test_complete_corrupt_and_incomplete_checkpoints_and_the_fallback(tmp_path):
    for it in (1, 3, 5, 7):
        _write(tmp_path, it)
    assert [c.iteration for c in checkpoints.scan(tmp_path) if c.complete] == [7, 5, 3, 1]
    # iteration 7: a flipped byte; iteration 5: a writer that never finished its part
    f = checkpoints.iteration_dir(tmp_path, 7) / "head.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    (checkpoints.iteration_dir(tmp_path, 5) / "embed.pt").unlink()
    it, skipped = checkpoints.newest_complete(tmp_path)
    assert it == 3
    assert [s.iteration for s in skipped] == [7, 5]
    assert "corrupt" in skipped[0].problem and "head.pt" in skipped[0].problem
    assert "missing" in skipped[1].problem
    assert checkpoints.newest_complete(tmp_path, at_most=2)[0] == 1
    assert load_component(tmp_path, 3, "embed")["embed.w"][0].tolist() == [4.0] * 3


def test_retention_keeps_the_newest_complete_ones(tmp_path):
    for it in range(6):
        _write(tmp_path, it)
    (checkpoints.iteration_dir(tmp_path, 5) / "manifest.json").unlink()  # still being written
    assert checkpoints.prune(tmp_path, 2) == [2, 1, 0]
    assert sorted(c.iteration for c in checkpoints.scan(tmp_path)) == [3, 4, 5]
    assert checkpoints.prune(tmp_path, 0) == []


def test_a_failed_write_is_a_result_not_an_exception(tmp_path):
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file where the folder should be")  # every write fails, even as root
    w = CheckpointWriter(blocker)
    w.submit(0, {"embed": {"embed.w": (torch.ones(2),)}}, COMPS)
    assert w.drain(30)
    (r,) = w.results()
    assert r.iteration == 0 and r.error and ("NotADirectory" in r.error or "FileExists" in r.error)
    assert not any(p.name.startswith("ckpt.") for p in tmp_path.iterdir())
    os.unlink(blocker)
    w.submit(1, {c: {f"{c}.w": (torch.ones(2),)} for c in COMPS}, COMPS)  # the next interval
    assert w.drain(30)
    (r,) = w.results()
    assert r.error is None and r.bytes > 0
    assert checkpoints.newest_complete(blocker)[0] == 1


# ------------------------------------------------------------ an adapter's own files
def _adapter_checkpoint(root: Path, it: int) -> Path:
    """What a DCP- or per-layer-style adapter writes: its own files, a subfolder, then the seal."""
    d = checkpoints.iteration_dir(root, it) / "dcp"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta %d" % it)
    (d / "__0_0.distcp").write_bytes(os.urandom(64))
    (d / "__1_0.distcp.tmp123").write_bytes(b"an unfinished write: never sealed")
    return d


def test_seal_lists_an_adapters_own_files_and_verify_checks_each(tmp_path):
    d = _adapter_checkpoint(tmp_path, 4)
    assert not checkpoints.verify(tmp_path, 4).complete  # not sealed yet: in progress
    assert checkpoints.newest_complete(tmp_path)[0] is None
    digests = checkpoints.seal(tmp_path, 4)
    assert sorted(digests) == ["dcp/.metadata", "dcp/__0_0.distcp"]
    assert checkpoints.verify(tmp_path, 4).complete
    assert checkpoints.newest_complete(tmp_path)[0] == 4
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[3] ^= 0x01
    (d / "__0_0.distcp").write_bytes(bytes(data))
    info = checkpoints.verify(tmp_path, 4)
    assert not info.complete and "__0_0.distcp is corrupt" in info.problem
    (d / "__0_0.distcp").unlink()
    assert "missing" in checkpoints.verify(tmp_path, 4).problem


def test_a_manifest_naming_a_path_outside_its_folder_is_not_complete(tmp_path):
    _adapter_checkpoint(tmp_path, 2)
    (tmp_path / "outside").write_bytes(b"x")
    import hashlib
    import json

    m = {"iteration": 2, "files": {"../outside": hashlib.sha256(b"x").hexdigest()}}
    (checkpoints.iteration_dir(tmp_path, 2) / "manifest.json").write_text(json.dumps(m))
    info = checkpoints.verify(tmp_path, 2)
    assert not info.complete and "not a path inside" in info.problem
    with pytest.raises(ValueError, match="not a path inside"):
        checkpoints.seal(tmp_path, 2, files=["../outside"])


def test_retention_and_the_restore_point_for_sealed_checkpoints(tmp_path):
    for it in (3, 7, 11):
        _adapter_checkpoint(tmp_path, it)
        checkpoints.seal(tmp_path, it)
    _adapter_checkpoint(tmp_path, 15)  # in flight: kept, not chosen
    # A job at iteration 10 (first uncommitted), interval 4: the due one is 7.
    assert checkpoints.restore_point(tmp_path, 10, 4, grace_s=0.0)[0] == 7
    # At 16 the due one (15) is still being written: wait, then fall back to 11.
    it, skipped = checkpoints.restore_point(tmp_path, 16, 4, grace_s=0.2)
    assert it == 11 and [s.iteration for s in skipped] == [15]
    assert checkpoints.restore_point(None, 10, 4) == (9, [])  # no checkpoints kept: survivors hold 9
    assert checkpoints.restore_point(tmp_path, 0, 4) == (None, [])
    assert checkpoints.prune(tmp_path, 2) == [3]
    assert [c.iteration for c in checkpoints.scan(tmp_path)] == [15, 11, 7]


def test_retention_hashes_a_checkpoint_once_until_its_files_change(tmp_path, monkeypatch):
    """Retention at every seal does not hash the kept checkpoints again while their files
    look unchanged; a file rewritten since (a flipped byte) is hashed again, found
    corrupt and not counted, so an older complete one is kept in its place."""
    for it in (1, 2, 3):
        _adapter_checkpoint(tmp_path, it)
        checkpoints.seal(tmp_path, it)
    hashed: list[str] = []
    real = checkpoints.file_sha256
    monkeypatch.setattr(checkpoints, "file_sha256", lambda p: hashed.append(str(p)) or real(p))
    assert checkpoints.prune(tmp_path, 2) == [1]
    assert hashed == []  # sealed here: known complete
    f = next(p for p in sorted(checkpoints.iteration_dir(tmp_path, 3).rglob("*"))
             if p.is_file() and p.name != checkpoints.MANIFEST)
    data = bytearray(f.read_bytes())
    data[0] ^= 0xFF
    f.write_bytes(bytes(data))
    _adapter_checkpoint(tmp_path, 4)
    checkpoints.seal(tmp_path, 4)
    hashed.clear()
    assert checkpoints.prune(tmp_path, 2) == []  # 3 is corrupt now: 4 and 2 are the two kept
    three = str(checkpoints.iteration_dir(tmp_path, 3))
    assert hashed and all(h.startswith(three) for h in hashed), hashed  # only the changed one again
    assert [c.iteration for c in checkpoints.scan(tmp_path) if c.complete] == [4, 2]
