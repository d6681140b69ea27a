"""Bounded resources before authentication, against a real controller process.

An unauthenticated peer may announce any frame size; the controller must not buffer it.
The bound stated in docs/security.md: 30 connections each announcing (and sending) a
16 MiB frame grow the controller's resident memory by less than 32 MiB (before the
handshake frame limit it grew by ~500 MB), and a real agent still authenticates after.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from resihp_core.protocol import client_handshake_sync

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SECRET = "preauth-test-secret"
RSS_BOUND = 32 * 1024 * 1024


def _start_controller(tmp_path: Path) -> tuple[subprocess.Popen, tuple[str, int]]:
    addr_file = tmp_path / "controller.addr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "resihp_core.runtime.controller", "--no-failslow",
         "--address-file", str(addr_file), "--log-level", "WARNING"],
        env=dict(os.environ, RESIHP_SECRET=SECRET), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not addr_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"controller did not start: {proc.communicate()[1].decode()[-2000:]}")
        time.sleep(0.05)
    host, port = addr_file.read_text().strip().rsplit(":", 1)
    return proc, (host, int(port))


def _flood_one(address: tuple[str, int], size: int) -> None:
    """Announce a ``size``-byte frame and try to send all of it."""
    try:
        with socket.create_connection(address, timeout=10) as s:
            s.sendall(struct.pack(">I", size))
            chunk = b"\x00" * (1 << 20)
            for _ in range(size // len(chunk)):
                s.sendall(chunk)
    except OSError:
        pass  # the controller closes the connection: what we want


def test_thirty_16mib_preauth_frames_keep_controller_memory_bounded(tmp_path: Path) -> None:
    proc, address = _start_controller(tmp_path)
    try:
        ps = psutil.Process(proc.pid)
        time.sleep(0.5)
        before = ps.memory_info().rss
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    peak[0] = max(peak[0], ps.memory_info().rss)
                except psutil.Error:
                    return
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        floods = [threading.Thread(target=_flood_one, args=(address, 16 * 1024 * 1024)) for _ in range(30)]
        for t in floods:
            t.start()
        for t in floods:
            t.join(60)
        time.sleep(0.3)
        stop.set()
        sampler.join()
        growth = peak[0] - before
        assert growth < RSS_BOUND, f"controller RSS grew by {growth / 2**20:.1f} MiB (bound 32 MiB)"
        assert proc.poll() is None, "controller died under the flood"
        # The listener still serves a real agent afterwards.
        with socket.create_connection(address, timeout=10) as s:
            client_handshake_sync(s, SECRET, "agent:0", role="agent", timeout=10)
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert "Traceback" not in err.decode(errors="replace"), err.decode(errors="replace")[-3000:]


def test_pending_handshakes_are_limited_and_shutdown_is_quiet(tmp_path: Path) -> None:
    """Over the limit (64 pending), extra connections are closed at once; at shutdown
    the silent pending ones end without a traceback."""
    proc, address = _start_controller(tmp_path)
    socks: list[socket.socket] = []
    try:
        for _ in range(80):
            socks.append(socket.create_connection(address, timeout=10))
        time.sleep(1.0)
        closed = 0
        for s in socks:
            s.settimeout(0.05)
            try:
                if s.recv(1) == b"":
                    closed += 1
            except (TimeoutError, socket.timeout):
                pass
            except OSError:
                closed += 1
        assert closed >= 80 - 64, f"only {closed} of 80 silent connections were refused (limit 64)"
        assert closed < 80, "every connection was refused: the limit is not per pending handshake"
        proc.terminate()
        _, err = proc.communicate(timeout=20)
        text = err.decode(errors="replace")
        assert proc.returncode == 0, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
