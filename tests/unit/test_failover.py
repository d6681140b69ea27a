"""The controller-failover logic without processes (docs/failover.md): the grace timer,
the authenticated job state (a tampered, foreign or out-of-bounds file is refused), the
job secret file's permissions and the one-controller lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from resihp_core.runtime.failover import (
    STATE_FILE,
    ControllerLock,
    ControllerRunning,
    GraceTimer,
    JobState,
    StateError,
    job_secret,
    read_state,
    remove_state,
    write_state,
)

SECRET = "a" * 64


def _state(**kw) -> JobState:
    base = dict(version=1, controller_host="127.0.0.1", controller_port=29400, store_address="127.0.0.1:40000",
                store_pid=1234, generation=3, committed=8, iterations=20, plan="resihp-plan v1\n...",
                devices=(0, 1, 2, 3), handled=(4,), nodes=(0, 1))
    base.update(kw)
    return JobState(**base)


def test_grace_timer_counts_one_absence_from_its_start():
    now = [100.0]
    t = GraceTimer(60.0, lambda: now[0])
    assert not t.absent and t.left() == 60.0 and not t.expired()
    t.lost()
    now[0] += 20
    t.lost()  # a second notice of the same absence does not restart it
    assert t.absent and t.left() == pytest.approx(40.0) and not t.expired()
    now[0] += 40
    assert t.left() == 0.0 and t.expired()
    t.regained()
    assert not t.absent and not t.expired() and t.left() == 60.0
    zero = GraceTimer(0.0, lambda: now[0])
    zero.lost()
    assert zero.expired()
    with pytest.raises(ValueError):
        GraceTimer(-1.0, lambda: 0.0)


def test_state_round_trips_and_is_private(tmp_path):
    write_state(tmp_path, _state(), SECRET)
    assert read_state(tmp_path, SECRET) == _state()
    assert os.stat(tmp_path / STATE_FILE).st_mode & 0o077 == 0
    remove_state(tmp_path)
    with pytest.raises(StateError, match="no controller state"):
        read_state(tmp_path, SECRET)


def test_a_tampered_or_foreign_state_file_is_refused(tmp_path):
    write_state(tmp_path, _state(), SECRET)
    path = tmp_path / STATE_FILE
    good = path.read_bytes()
    # Another job's secret does not verify it.
    with pytest.raises(StateError, match="does not verify"):
        read_state(tmp_path, "b" * 64)
    # One field changed (the store address an attacker wants the controller to trust).
    path.write_bytes(good.replace(b"127.0.0.1:40000", b"10.6.6.6:40000"))
    with pytest.raises(StateError, match="does not verify"):
        read_state(tmp_path, SECRET)
    # A forged MAC of the right shape.
    doc = json.loads(good)
    doc["mac"] = "0" * 64
    path.write_text(json.dumps(doc))
    with pytest.raises(StateError, match="does not verify"):
        read_state(tmp_path, SECRET)
    # Not a state file at all, an extra field, and a huge file.
    path.write_text("{}")
    with pytest.raises(StateError, match="not a controller state file"):
        read_state(tmp_path, SECRET)
    doc = json.loads(good)
    doc["extra"] = 1
    path.write_text(json.dumps(doc))
    with pytest.raises(StateError, match="not a controller state file"):
        read_state(tmp_path, SECRET)
    path.write_bytes(b" " * (2 << 20))
    with pytest.raises(StateError, match="larger than"):
        read_state(tmp_path, SECRET)
    path.write_bytes(good)
    assert read_state(tmp_path, SECRET).store_address == "127.0.0.1:40000"


def test_a_correctly_signed_state_with_a_hostile_field_is_refused(tmp_path):
    """The MAC proves who wrote it, the bounds what it may say: a signed file with a
    field out of bounds (a bug, an old version) is still refused."""
    import hashlib
    import hmac

    from resihp_core.runtime import failover

    good = json.loads(json.dumps({f: getattr(_state(), f) for f in JobState.__struct_fields__}))
    for field, bad in [("controller_port", 0), ("store_address", "host:port; rm -rf /"), ("devices", [0, 0]),
                       ("handled", [0]), ("committed", 21), ("version", 2), ("store_pid", -1),
                       ("controller_host", "a b")]:
        body = json.dumps(dict(good, **{field: bad})).encode()
        mac = hmac.new(failover._key(SECRET), failover._MAC_DOMAIN + body, hashlib.sha256).hexdigest()
        (tmp_path / STATE_FILE).write_bytes(b'{"mac":"' + mac.encode() + b'","state":' + body + b"}")
        with pytest.raises(StateError, match="out of bounds"):
            read_state(tmp_path, SECRET)


def test_the_job_secret_file_is_made_once_and_refused_when_open_to_others(tmp_path):
    s = job_secret(tmp_path, create=True)
    assert len(s) == 64 and job_secret(tmp_path, create=True) == s == job_secret(tmp_path, create=False)
    path = tmp_path / "job.secret"
    assert os.stat(path).st_mode & 0o777 == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(StateError, match="open to group or others"):
        job_secret(tmp_path, create=False)
    os.chmod(path, 0o600)
    path.rename(tmp_path / "real")
    os.symlink(tmp_path / "real", path)
    with pytest.raises(StateError, match="link"):
        job_secret(tmp_path, create=False)
    with pytest.raises(StateError):
        job_secret(tmp_path / "missing", create=False)


def test_a_second_controller_is_refused_while_the_first_holds_the_lock(tmp_path):
    code = ("import sys, time; from resihp_core.runtime.failover import ControllerLock; "
            "ControllerLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ControllerRunning, match=rf"a controller \(pid {holder.pid}\) is already running"):
            ControllerLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait(10)
    # The holder died (however): the kernel dropped its lock.
    with ControllerLock(tmp_path) as lock:
        assert lock is not None
    ControllerLock(tmp_path).acquire().release()


def test_workers_hold_their_commit_while_no_controller_steers_the_store():
    import threading
    import time

    from resihp_core.protocol import node_credential
    from resihp_core.runtime import session
    from resihp_core.runtime.store import StoreClient, StoreError, StoreServer

    server = StoreServer("127.0.0.1", SECRET, presence=True)
    try:
        ctl = StoreClient(server.address, SECRET, "controller", timeout_s=30)
        worker = StoreClient(server.address, node_credential(SECRET, 0), "worker:0:0", timeout_s=30)
        probe = StoreClient(server.address, node_credential(SECRET, 0), "worker:0:1", timeout_s=30)
        ctl.set(session.PRESENT_KEY, "1")
        with pytest.raises(StoreError, match="may not write"):
            worker.set(session.PRESENT_KEY, "1")  # only a controller steers
        with pytest.raises(StoreError, match="may not write"):
            worker.set(session.SHUTDOWN_KEY, "1")
        assert session.commit(worker, 0, 0, 1, hold_s=30) == session.CommitResult.COMMITTED
        ctl.close()  # the controller dies: its connection closes
        deadline = time.monotonic() + 10
        while worker.check([session.PRESENT_KEY]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker.check([session.PRESENT_KEY])
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(session.commit(worker, 0, 1, 1, hold_s=30)))
        t.start()
        t.join(0.5)
        assert not got and not probe.check(["ctl0/verdict1"]), "iteration 1 must be held, not committed"
        back = StoreClient(server.address, SECRET, "controller", timeout_s=30)  # a restarted controller
        assert not got  # connecting is not steering
        back.set(session.PRESENT_KEY, "1")
        t.join(10)
        assert got == [session.CommitResult.COMMITTED]
        back.close()
        deadline = time.monotonic() + 10
        while worker.check([session.PRESENT_KEY]) and time.monotonic() < deadline:
            time.sleep(0.01)
        # Nobody came back within the worker's own bound: the iteration is aborted.
        assert session.commit(worker, 0, 2, 1, hold_s=0.3) == session.CommitResult.ABORTED
        worker.close()
        probe.close()
    finally:
        server.close()


def test_a_fresh_run_is_refused_while_the_old_job_runs_without_a_controller(tmp_path):
    import argparse

    from resihp_core.cli import CliError
    from resihp_core.cli.run import _attachable
    from resihp_core.runtime.store import StoreServer

    server = StoreServer("127.0.0.1", SECRET, presence=True)
    try:
        write_state(tmp_path, _state(store_address=server.address), SECRET)
        fresh, resume = argparse.Namespace(resume=False), argparse.Namespace(resume=True)
        with pytest.raises(CliError, match="still running without a controller"):
            _attachable(fresh, tmp_path, SECRET)
        assert _attachable(resume, tmp_path, SECRET).store_address == server.address
        deadline = time.monotonic() + 10.0  # the server sees the probe's close on its own thread
        while server.controllers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.controllers == 0 and not server.table.check(["controller/present"])
    finally:
        server.close()
    assert _attachable(fresh, tmp_path, SECRET) is None  # its store is gone: start afresh
    # A state file that does not verify is never used to re-attach.
    assert _attachable(resume, tmp_path, "c" * 64) is None
