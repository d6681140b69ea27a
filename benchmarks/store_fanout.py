"""The job store's commit fan-out against the job's nodes: how long the real store takes
from the add that completes an iteration's count to the verdict in every node agent's
hands (issue 34: commit overhead p99 <= 5 ms at 16,384 ranks).

Why: with the commit aggregated per node, an iteration of a 16,384-rank job (2,048
nodes of 8) parks 2,047 agents' ``commit`` requests in the store; the last node's add
writes the verdict and the store answers every parked request. That fan-out is the
store's part of the commit latency. ``control_scale.py`` measures the whole control
plane with emulated ranks; on a machine of few cores its commit latencies are mostly
the emulators' own queueing. Here every node is one connection and one waiting thread,
so 2,048 nodes fit on a small machine; the store's CPU for the fan-out is its own cost
whatever the host, and its wall time is that CPU plus, on a machine of few cores, the
woken client threads' turns on the cores.

What runs: the real :class:`~resihp_core.runtime.store.StoreServer` in this process
and, per node, one real :class:`~resihp_core.runtime.store_wire.WireStore` connection
(identity ``agent:<node>``, its node credential, the authenticated handshake), as the
node agents hold them, from ``--procs`` client processes (one thread per node). Each
iteration every node but one sends its ``commit`` (``add_and_await``, what
:func:`resihp_core.runtime.session.commit_batch` sends); once all of them are parked in
the store, the last node's add completes the count. Measured per iteration, from that
completing add (``time.monotonic``, the same clock in every process of the host):

- ``server_ms``: to the last parked request's reply handed to its connection;
- ``client_ms``: to the last node holding its verdict;
- ``store_cpu_ms``: the store thread's CPU over that time, and per node.

``--stores torch`` runs the same pattern on torch's ``TCPStore`` (its libuv server, in
C++; no authentication, no commit operation: an ``add``, then a blocking ``get`` of the
verdict the last adder ``set``s), the replacement issue 34 names, for comparison; there
the CPU is this whole process's.

Usage: python benchmarks/store_fanout.py [--nodes 128,512,2048] [--iterations 20] [--procs 4]
       [--stores resihp,torch] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SECRET = "store-fanout-bench"


def _client(address: str, first: int, count: int) -> None:
    """A client process: nodes ``first .. first+count-1``, one thread and one store
    connection each. Reads ``go <iteration>`` lines; every node commits; prints each
    iteration's receive times (monotonic) as one JSON line."""
    target = int(os.environ["FANOUT_TARGET"])
    got = [0.0] * count
    if os.environ.get("FANOUT_STORE") == "torch":
        import datetime

        from torch.distributed import TCPStore

        host, _, port = address.rpartition(":")
        stores = [TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=120))
                  for _ in range(count)]

        def commit(i: int, it: int) -> None:  # the same two steps without a commit op: add, then wait
            stores[i].add(f"c/{it}", 1)
            stores[i].get(f"v/{it}")
            got[i] = time.monotonic()
    else:
        from resihp_core.protocol.auth import node_credential
        from resihp_core.runtime.store_wire import WireStore

        stores = [WireStore(address, node_credential(SECRET, n), f"agent:{n}", timeout_s=120.0) for n in
                  range(first, first + count)]

        def commit(i: int, it: int) -> None:
            node = first + i
            stores[i].add_and_await([f"r/{it}/{node}"], [b"x"], f"c/{it}", 1, target, f"v/{it}", True, 60.0)
            got[i] = time.monotonic()

    print(json.dumps({"ready": count}), flush=True)

    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "go":
            break
        it = int(cmd[1])
        threads = [threading.Thread(target=commit, args=(i, it)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(json.dumps({"iteration": it, "received": max(got)}), flush=True)
    for st in stores:
        getattr(st, "close", lambda: None)()


class _Timed:
    """Wraps the store's reply writer: when each reply was handed to its connection."""

    def __init__(self) -> None:
        from resihp_core.runtime import store

        self.done: list[float] = []
        self._inner = inner = store._reply

        def reply(writer, value) -> None:
            inner(writer, value)
            self.done.append(time.monotonic())

        store._reply = reply

    def undo(self) -> None:
        from resihp_core.runtime import store

        store._reply = self._inner


class _Ours:
    """ResiHP's job store: its server here, the closing node's connection, its waiters."""

    def __init__(self) -> None:
        from resihp_core.protocol.auth import node_credential
        from resihp_core.runtime.store import StoreServer
        from resihp_core.runtime.store_wire import WireStore

        self.server = StoreServer("127.0.0.1", SECRET, 0)
        self.address = self.server.address
        self._connect = lambda node: WireStore(self.address, node_credential(SECRET, node), f"agent:{node}",
                                               timeout_s=120.0)
        self.timed = _Timed()
        self.cpu_clock = time.pthread_getcpuclockid(self.server._thread.ident)

    def cpu(self) -> float:  # the store's thread
        return time.clock_gettime(self.cpu_clock)

    def parked(self, it: int, others: int) -> bool:
        return self.server.table.waiting() >= others

    def closer(self, nodes: int):
        """The closing (last) node's connection: this process's own."""
        return self._connect(nodes - 1)

    def close_count(self, store, it: int, nodes: int) -> None:
        store.add_and_await([f"r/{it}/{nodes - 1}"], [b"x"], f"c/{it}", 1, nodes, f"v/{it}", True, 60.0)

    def close(self, closer) -> None:
        closer.close()
        self.timed.undo()
        self.server.close()


class _Torch:
    """torch's TCPStore (libuv), unauthenticated, for comparison: the same count and
    verdict in two operations (an add, then a blocking get; the last add's node sets
    the verdict). It cannot tell how many gets are parked: the closing add waits until
    the count has every other node's add and 50 ms more."""

    def __init__(self) -> None:
        import datetime

        from torch.distributed import TCPStore

        self.master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=120))
        self.address = f"127.0.0.1:{self.master.port}"
        self.timed = None

    def cpu(self) -> float:  # the whole process: the store's own threads, this one mostly waiting
        return time.process_time()

    def parked(self, it: int, others: int) -> bool:
        if self.master.add(f"c/{it}", 0) < others:
            return False
        time.sleep(0.05)
        return True

    def closer(self, nodes: int):
        """The closing node's client: the server's own."""
        return self.master

    def close_count(self, store, it: int, nodes: int) -> None:
        if store.add(f"c/{it}", 1) == nodes:
            store.set(f"v/{it}", "commit")

    def close(self, closer) -> None:
        pass  # the server goes with its object


def run(nodes: int, iterations: int, procs: int, kind: str = "resihp") -> dict:
    store = _Ours() if kind == "resihp" else _Torch()
    last = nodes - 1  # the closing node: this process
    per = [(last * k // procs, last * (k + 1) // procs) for k in range(procs)]
    env = dict(os.environ, FANOUT_TARGET=str(nodes), FANOUT_STORE=kind, PYTHONPATH=str(ROOT))
    clients = [subprocess.Popen([sys.executable, __file__, "--_client", store.address, str(a), str(b - a)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
               for a, b in per if b > a]
    closer = store.closer(nodes)
    rows = []
    try:
        t0 = time.monotonic()
        for c in clients:
            json.loads(c.stdout.readline())
        print(f"  {nodes} nodes connected in {time.monotonic() - t0:.1f} s", flush=True)
        for it in range(iterations):
            if store.timed is not None:
                store.timed.done.clear()
            for c in clients:
                c.stdin.write(f"go {it}\n")
                c.stdin.flush()
            deadline = time.monotonic() + 120
            while not store.parked(it, last):  # every other node's commit waits in the store
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not every other node's commit reached the store in {it}")
                time.sleep(0.002)
            cpu0 = store.cpu()
            t_add = time.monotonic()
            store.close_count(closer, it, nodes)
            received = max(json.loads(c.stdout.readline())["received"] for c in clients)
            cpu1 = store.cpu()
            row = {"iteration": it, "client_ms": 1e3 * (received - t_add), "store_cpu_ms": 1e3 * (cpu1 - cpu0)}
            if store.timed is not None:
                row["server_ms"] = 1e3 * (max(store.timed.done) - t_add)
            rows.append(row)
            print(f"  {kind}, {nodes} nodes, iteration {it}: "
                  + (f"store {row['server_ms']:.1f} ms, " if "server_ms" in row else "")
                  + f"every node {row['client_ms']:.1f} ms", flush=True)
    finally:
        for c in clients:
            try:
                c.stdin.close()
            except OSError:
                pass
        for c in clients:
            try:
                c.wait(timeout=30)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
        store.close(closer)
    steady = rows[2:] or rows
    out = {"store": kind, "nodes": nodes, "ranks_at_8_per_node": 8 * nodes, "iterations": iterations, "rows": rows}
    for k in ("server_ms", "client_ms", "store_cpu_ms"):
        v = sorted(r[k] for r in steady if k in r)
        if v:
            out[f"{k}_p50"] = statistics.median(v)
            out[f"{k}_max"] = v[-1]
    out["store_cpu_us_per_node"] = 1e3 * out["store_cpu_ms_p50"] / max(1, last)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="128,512,2048", help="nodes per run (8 ranks each: 1,024 to 16,384 ranks)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--json")
    ap.add_argument("--stores", default="resihp,torch",
                    help="resihp (the job store), torch (torch's TCPStore, libuv, for comparison)")
    args = ap.parse_args(argv)
    t0 = time.time()
    load = [os.getloadavg()[0]]
    runs = []
    for n in (int(x) for x in args.nodes.split(",")):
        for kind in args.stores.split(","):
            print(f"{kind}: {n} nodes ({8 * n:,} ranks at 8 per node), {args.iterations} iterations", flush=True)
            runs.append(run(n, args.iterations, args.procs, kind))
            load.append(os.getloadavg()[0])
    print("\n| store | nodes | ranks (8 per node) | completing add -> last reply written, p50 / max ms | "
          "-> verdict at every node, p50 / max ms | store CPU per iteration ms | per node us |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        written = f"{r['server_ms_p50']:.1f} / {r['server_ms_max']:.1f}" if "server_ms_p50" in r else "-"
        print(f"| {r['store']} | {r['nodes']:,} | {r['ranks_at_8_per_node']:,} | {written} | "
              f"{r['client_ms_p50']:.1f} / {r['client_ms_max']:.1f} | {r['store_cpu_ms_p50']:.1f} | "
              f"{r['store_cpu_us_per_node']:.1f} |")
    if args.json:
        from benchstats import machine

        command = "python benchmarks/store_fanout.py " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.json).write_text(json.dumps({
            "_run": {"command": command,
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "machine": machine()},
            "loadavg": [round(min(load), 2), round(max(load), 2)], "wall_s": round(time.time() - t0),
            "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_client":
        _client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main())
