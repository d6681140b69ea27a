"""Start N worker processes of a script around a TCPStore this process hosts; always
clean up by pid."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(script: str, world: int, args: list[str], timeout_s: float, out_dir: str) -> list[int]:
    """Run ``script`` as ranks 0..world-1; return their exit codes (raises on timeout)."""
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1")
            log = open(os.path.join(out_dir, f"rank{r}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, script), "--store", f"127.0.0.1:{store.port}", "--out", out_dir, *args],
                env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        del store


def tail(out_dir: str, world: int, n: int = 25) -> str:
    """The end of every rank's log, for assertion messages."""
    parts = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.log")) as f:
            lines = [ln for ln in f.read().splitlines() if "[INFO]" not in ln]
        parts.append(f"--- rank {r}\n" + "\n".join(lines[-n:]))
    return "\n".join(parts)
