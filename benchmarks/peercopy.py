"""What a memory copy on a peer costs (docs/checkpoints.md, "Memory copies on peers"):
the time the training thread pays to hand its rollback snapshot over, the background
thread's time to serialize it, keep it and send it to its buddy's listener, the bytes
one copy takes in host memory, and the time a restore takes to read every component
back from the buddy.

    benchmarks/peercopy.py [--quick] [--runs N] [--json PATH]

For the reference backend's model at several widths (4 layers, float32, parameters and
both AdamW moments: what ``megatron_ref`` hands over for TP1 x PP1), median of
``--runs`` copies, with the load average next to it. Both holders run in this process
and talk over loopback TCP (the same code path as two hosts, without the network), so
the background time is an upper bound on the CPU one copy takes from training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(hidden: int, runs: int) -> dict:
    import torch

    from resihp_core.plan import ParallelPlan
    from resihp_core.runtime.peercopy import HELD_KEY, MemoryCopy, MemoryPiece, PeerCopies
    from resihp_core.runtime.store import LocalStore, _Table
    from resihp_adapters.megatron_ref.model import ModelConfig, build_model
    from resihp_adapters.megatron_ref.state import component_of

    cfg = ModelConfig(vocab_size=1024, hidden=hidden, num_heads=4, ffn_hidden=4 * hidden, num_layers=4,
                      dtype="float32")
    net = build_model(cfg)
    store = LocalStore(_Table(), timeout_s=60.0)
    me, buddy = PeerCopies(0, store, node=0), PeerCopies(1, store, node=1)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=1)
    comps = tuple(sorted({component_of(n) for n, _ in net.named_parameters()}))
    hand_s, background_s, read_s = [], [], []
    try:
        for it in range(runs):
            # the rollback snapshot (the worker takes it anyway): not counted
            snap = {n: (p.detach().clone(), torch.randn_like(p), torch.rand_like(p)) for n, p in net.named_parameters()}
            t0 = time.perf_counter()  # what memory_copy() and offer() cost the training thread
            by_comp: dict = {}
            for name, ts in snap.items():
                by_comp.setdefault(component_of(name), {})[name] = ts
            me.offer(it, 0, MemoryCopy(tuple(MemoryPiece(c, 0, 1, ts) for c, ts in sorted(by_comp.items())), comps),
                     [0, 1], plan)
            t1 = time.perf_counter()
            if not me.idle(300):
                raise RuntimeError("the copy was not sent in 300 s")
            t2 = time.perf_counter()
            hand_s.append(t1 - t0)
            background_s.append(t2 - t1)
            read = me.reader(it, {c: [1] for c in comps})
            t0 = time.perf_counter()
            got = {c: read(c) for c in comps}
            read_s.append(time.perf_counter() - t0)
            for c, (piece,) in got.items():
                for name, ts in piece.tensors.items():
                    if not all(torch.equal(a, b) for a, b in zip(ts, snap[name])):
                        raise RuntimeError(f"{name} read back differs from the snapshot")
        held = json.loads(store.get(HELD_KEY.format(1)))
        if not held:
            raise RuntimeError("the buddy holds nothing")
        one = sum(len(b) for pieces in buddy._held.values() for _g, b in pieces.values()) / max(1, len(buddy._held))
    finally:
        me.close()
        buddy.close()
    params = sum(p.numel() for p in net.parameters())
    return dict(hidden=hidden, parameters=params, bytes_per_copy=int(one), copies_held=len(buddy._held),
                handover_ms=statistics.median(hand_s) * 1e3, background_ms=statistics.median(background_s) * 1e3,
                restore_read_ms=statistics.median(read_s) * 1e3, runs=runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two widths, 3 runs")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    widths = [64, 256] if args.quick else [64, 256, 512, 1024]
    runs = 3 if args.quick else args.runs
    try:
        rows = [measure(h, runs) for h in widths]
    except RuntimeError as e:
        print(f"could not measure: {e}", file=sys.stderr)
        return 1
    load = open("/proc/loadavg").read().split()[:3]
    print(f"memory copy on a peer, median of {runs} copies (load average {' '.join(load)})")
    print(f"{'hidden':>7} {'params':>10} {'bytes/copy':>12} {'hand-over ms':>13} {'background ms':>14} "
          f"{'restore read ms':>16}")
    for r in rows:
        print(f"{r['hidden']:>7} {r['parameters']:>10} {r['bytes_per_copy']:>12} {r['handover_ms']:>13.3f} "
              f"{r['background_ms']:>14.1f} {r['restore_read_ms']:>16.1f}")
    from resihp_core.runtime.peercopy import KEEP_PER_SOURCE

    print("hand-over: paid by the training thread; background: serialize, keep, send to the buddy (loopback); "
          f"restore read: every component back from the buddy. A holder keeps {KEEP_PER_SOURCE} copies per source.")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, loadavg=load), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
