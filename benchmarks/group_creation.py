"""gloo process-group creation against world size on this machine (docs/benchmarks.md).

For each world size N (default 2, 4, 8, 16, 32) it starts N worker processes on this
host, one TCPStore between them, and times, per repetition:

* ``world``: ``init_process_group("gloo")`` over the N ranks (a rebuild's world);
* ``new_group world``: ``new_group`` of all N ranks inside the live world;
* ``pairs``: ``new_group`` of the N/2 pairs (every rank creates every pair, as torch
  requires; a generation's TP / DP-chunk groups are made this way);
* ``split``: ``split_group`` of the live world into the same pairs, where torch allows
  it; on a CPU build it refuses (the reason is recorded once) and the row says so;
* ``shrink``: ``shrink_group`` of the world by one rank, where the backend supports
  shrinking; otherwise recorded as unsupported.

Then, once, with two ranks: whether aborting a gloo group releases an all-reduce blocked
in it with a silent peer (what keeping a gloo world across generations would need).

Each operation starts after a store barrier; its time is the slowest rank's (a group is
usable when its last member has it); the figure is the median over repetitions. The
growth is fitted as ``t = a * N^b`` (least squares on log-log) per operation. The
machine's load average is recorded before and after; with more ranks than cores the
ranks take turns on the CPU, which is part of what the figures show.

Usage: python benchmarks/group_creation.py [--quick] [--sizes 2,4,8] [--reps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchstats import loadavg, machine  # noqa: E402

OPS = ("world", "new_group world", "pairs", "split", "shrink")
TIMEOUT = datetime.timedelta(seconds=120)


# ------------------------------------------------------------------ one worker process
def _worker(rank: int, n: int, port: int, reps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    times: dict[str, list[float]] = {op: [] for op in OPS}
    notes: dict[str, str] = {}
    step = [0]

    def barrier() -> None:  # the last to arrive opens it: no polling load on the store
        step[0] += 1
        if store.add(f"b{step[0]}", 1) == n:
            store.set(f"b{step[0]}/open", "1")
        store.wait([f"b{step[0]}/open"])

    def timed(op: str, fn) -> object:  # noqa: ANN001 - a zero-argument callable
        barrier()
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - an unsupported operation is a finding
            notes.setdefault(op, f"{type(e).__name__}: {e}".splitlines()[0][:200])
            return None
        times[op].append(time.perf_counter() - t0)
        return result

    pairs = [[2 * i, 2 * i + 1] for i in range(n // 2)]
    for r in range(reps):
        timed("world", lambda: dist.init_process_group("gloo", store=dist.PrefixStore(f"r{r}/", store),
                                                       rank=rank, world_size=n, timeout=TIMEOUT))
        timed("new_group world", lambda: dist.new_group(list(range(n)), timeout=TIMEOUT))
        timed("pairs", lambda: [dist.new_group(p, timeout=TIMEOUT) for p in pairs])
        timed("split", lambda: dist.split_group(split_ranks=pairs, timeout=TIMEOUT))
        c10d = dist.distributed_c10d
        if rank == n - 1:  # the excluded rank takes no part in a shrink
            barrier()
            notes.setdefault("shrink", _shrink_support(dist))
        elif hasattr(c10d, "shrink_group"):
            timed("shrink", lambda: c10d.shrink_group([n - 1]))
        else:
            barrier()
            notes.setdefault("shrink", "torch has no shrink_group")
        dist.destroy_process_group()
        c10d._world.group_count = 0
        barrier()
    (out / f"{rank}.json").write_text(json.dumps({"times": times, "notes": notes}))


def _shrink_support(dist) -> str:  # noqa: ANN001 - the torch.distributed module
    try:
        pg = dist.distributed_c10d._get_default_group()
        import torch

        ok = bool(getattr(pg._get_backend(torch.device("cpu")), "supports_shrinking", False))
        return "gloo reports supports_shrinking" if ok else "gloo does not support shrinking"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:200]


def _abort_worker(rank: int, port: int, out: Path) -> None:
    """Rank 1 enters an all-reduce rank 0 never joins and aborts its groups from another
    thread after ``ABORT_AFTER_S``: how long the all-reduce stays blocked."""
    import threading

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=ABORT_TIMEOUT_S))
    dist.all_reduce(torch.ones(1))
    if rank == 0:  # silent: alive, sockets open
        store.wait(["abort/done"])
        return
    threading.Timer(ABORT_AFTER_S, dist.distributed_c10d._abort_process_group).start()
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
        error = None
    except Exception as e:  # noqa: BLE001 - how it ended is the finding
        error = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    (out / "abort.json").write_text(json.dumps({"blocked_s": time.perf_counter() - t0, "error": error}))
    store.set("abort/done", "1")


ABORT_AFTER_S, ABORT_TIMEOUT_S = 0.5, 5.0


def abort_probe(limit_s: float = 120.0) -> dict:
    """Does aborting a gloo group release an operation blocked in it? (It would let a
    generation keep a gloo world: docs/gpu.md, "Communicators per generation".)"""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="resihp-abort-") as tmp:
        procs = [subprocess.Popen([sys.executable, __file__, "--abort-worker", str(r), str(store.port), tmp], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
        _wait_or_kill(procs, limit_s)
        f = Path(tmp) / "abort.json"
        res = json.loads(f.read_text()) if f.exists() else {"error": "no report"}
    res.update(abort_after_s=ABORT_AFTER_S, op_timeout_s=ABORT_TIMEOUT_S,
               released_by_abort=res.get("blocked_s", ABORT_TIMEOUT_S) < ABORT_TIMEOUT_S - 1.0)
    return res


# ------------------------------------------------------------------ the driver
def _wait_or_kill(procs: list[subprocess.Popen], limit_s: float) -> None:
    """Wait for ``procs`` up to ``limit_s`` in all, then kill (by pid) what still runs:
    only what this script started."""
    t0 = time.monotonic()
    try:
        for p in procs:
            p.wait(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_size(n: int, reps: int, limit_s: float) -> dict:
    """Start ``n`` workers, wait for them (kill by pid at ``limit_s``), gather their times."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="resihp-groups-") as tmp:
        out = Path(tmp)
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(n), str(store.port), str(reps),
                                   tmp], env=env, stdout=subprocess.DEVNULL, stderr=open(out / f"{r}.log", "w"))
                 for r in range(n)]
        _wait_or_kill(procs, limit_s)
        ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(n) if (out / f"{r}.json").exists()]
        if len(ranks) < n:
            tail = (out / "0.log").read_text()[-500:] if (out / "0.log").exists() else ""
            return {"n": n, "error": f"{n - len(ranks)} rank(s) wrote nothing within {limit_s:.0f} s: {tail}"}
    row: dict = {"n": n, "reps": reps, "seconds": {}, "notes": {}}
    for op in OPS:
        per_rep = [r["times"][op] for r in ranks if r["times"][op]]
        counts = {len(x) for x in per_rep}
        if per_rep and len(counts) == 1:
            slowest = [max(x[i] for x in per_rep) for i in range(counts.pop())]
            row["seconds"][op] = {"median": statistics.median(slowest), "min": min(slowest), "max": max(slowest)}
        notes = {r["notes"][op] for r in ranks if op in r["notes"]}
        if notes:
            row["notes"][op] = sorted(notes)[0]
    return row


def fit(points: list[tuple[int, float]]) -> dict | None:
    """``t = a * N^b`` by least squares on log-log; None with fewer than two sizes."""
    pts = [(math.log(n), math.log(t)) for n, t in points if t > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = math.exp(my - b * mx)
    ss = sum((y - my) ** 2 for _, y in pts)
    r2 = 1.0 - sum((y - (math.log(a) + b * x)) ** 2 for x, y in pts) / ss if ss > 0 else 1.0
    return {"a": a, "b": b, "r2": r2}


def table(rows: list[dict], fits: dict[str, dict | None]) -> str:
    lines = [f"{'ranks':>5s} " + " ".join(f"{op + ' ms':>18s}" for op in OPS)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['n']:>5d}  error: {r['error'][:200]}")
            continue
        cells = []
        for op in OPS:
            s = r["seconds"].get(op)
            cells.append(f"{1e3 * s['median']:>18.1f}" if s else f"{'unsupported':>18s}")
        lines.append(f"{r['n']:>5d} " + " ".join(cells))
    lines.append("growth, t = a * N^b: " + "; ".join(
        f"{op}: b = {f['b']:.2f} (R^2 {f['r2']:.2f})" for op, f in fits.items() if f))
    notes = {}
    for r in rows:
        for op, note in r.get("notes", {}).items():
            notes.setdefault(op, note)
    for op, note in notes.items():
        lines.append(f"{op}: {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8,16,32", help="world sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per size (median reported)")
    ap.add_argument("--quick", action="store_true", help="sizes 2,4,8 and 3 repetitions")
    ap.add_argument("--limit-s", type=float, default=300.0, help="per world size, then its workers are killed")
    ap.add_argument("--json", help="write the rows, fits and machine here")
    args = ap.parse_args(argv)
    sizes = [2, 4, 8] if args.quick else [int(x) for x in args.sizes.split(",")]
    reps = 3 if args.quick else args.reps
    if any(n < 2 or n % 2 for n in sizes):
        ap.error(f"--sizes: every world size must be even and >= 2, got {sizes}")
    import torch

    before = loadavg()
    t0 = time.monotonic()
    rows = []
    for n in sizes:
        print(f"  {n} ranks ...", flush=True)
        rows.append(run_size(n, reps, args.limit_s))
    print("  gloo abort of a blocked operation ...", flush=True)
    aborted = abort_probe()
    fits = {op: fit([(r["n"], r["seconds"][op]["median"]) for r in rows if op in r.get("seconds", {})])
            for op in OPS}
    after = loadavg()
    text = table(rows, fits) + (
        f"\ngloo abort: an all-reduce with a silent peer, its group aborted after {ABORT_AFTER_S} s, stayed blocked "
        f"{aborted.get('blocked_s', float('nan')):.2f} s (op timeout {ABORT_TIMEOUT_S} s): "
        f"{'released by the abort' if aborted['released_by_abort'] else 'not released by the abort'}")
    summary = (f"load average (1, 5, 15 min) before {before}, after {after}; {os.cpu_count()} cores; "
               f"{time.monotonic() - t0:.0f} s")
    out = {"torch": torch.__version__, "machine": {**machine(), "torch": torch.__version__},
           "command": "python benchmarks/group_creation.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "loadavg": [x for x in (before, after) if x], "sizes": sizes, "reps": reps, "rows": rows, "fits": fits,
           "gloo_abort": aborted,
           "seconds": time.monotonic() - t0,
           "markdown": "Medians of the slowest rank's time, ms:\n\n```\n" + text + "\n```\n\n" + summary}
    print(text)
    print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--abort-worker":
        _abort_worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    else:
        sys.exit(main())
