"""What silent-data-corruption checks cost per iteration (docs/sdc.md, "Cost"): the
worker's fingerprint of its shard (parameters and two AdamW moments) for shards of
several sizes, whole and at partial coverage (``RESIHP_SDC_COVERAGE``); the range
signal (the norm of the shard's gradient); and the comparison the last executor runs
before its verdict (reading every executor's fingerprint from the job store over TCP),
each as a share of a 0.5 s iteration. Prints a table and writes JSON.

Usage: python benchmarks/sdc_cost.py [--sizes 1e5,1e6,4e6,1.6e7] [--coverage 1,0.25]
       [--dtype float32] [--device cpu|cuda] [--executors 2,8,32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ITERATION_S = 0.5  # the bar: <= 1 % of an iteration of at least this long


def digest_ms(params: int, dtype: str, device: str, share: float = 1.0, repeats: int = 7) -> float:
    """Median milliseconds of one fingerprint of a shard of ``params`` parameters held
    as 16 named tensors, with its two AdamW moments, reading ``share`` of each (the
    window turning each repeat, as iterations turn it)."""
    import torch

    from resihp_core.detector.sdc import tensor_digest

    dt = getattr(torch, dtype)
    per = max(1, params // 16)
    named = [(f"{k}.layer{i}", torch.randn(per, dtype=dt, device=device)) for i in range(16) for k in "pmv"]
    tensor_digest(named, share=share)  # warm-up (allocator, kernels)
    times = []
    for turn in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tensor_digest(named, share=share, turn=turn)
        times.append(time.perf_counter() - t0)  # the digest ends with a copy to the host
    return statistics.median(times) * 1e3


def grad_norm_ms(params: int, dtype: str, device: str, repeats: int = 7) -> float:
    """Median milliseconds of the range signal: the norm of the shard's gradient held
    as 16 tensors."""
    import torch

    from resihp_core.detector.sdc import grad_norm

    dt = getattr(torch, dtype)
    grads = [torch.randn(max(1, params // 16), dtype=dt, device=device) for _ in range(16)]
    grad_norm(grads)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        grad_norm(grads)  # ends with a copy to the host
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def adamw_ms(params: int, dtype: str, device: str, repeats: int = 7) -> float:
    """Median milliseconds of one ``torch.optim.AdamW`` step over the same shard (the
    work the fingerprint follows, for scale)."""
    import torch

    dt = getattr(torch, dtype)
    per = max(1, params // 16)
    ps = [torch.nn.Parameter(torch.randn(per, dtype=dt, device=device)) for _ in range(16)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-3)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def check_ms(executors: int, repeats: int = 20) -> float:
    """Median milliseconds of the last executor's comparison of ``executors``
    fingerprints, read over a worker's authenticated TCP connection."""
    from resihp_core.detector.sdc import Fingerprint, commit_check
    from resihp_core.protocol import node_credential
    from resihp_core.runtime import session
    from resihp_core.runtime.store import StoreClient, StoreServer, worker_store_identity

    secret = "bench-secret"
    srv = StoreServer("127.0.0.1", secret)
    try:
        client = StoreClient(srv.address, node_credential(secret, 0), worker_store_identity(0, 0), timeout_s=10)
        times = []
        for it in range(repeats):
            for d in range(executors):
                session.put_fingerprint(client, 0, it, d, Fingerprint("stage0/tp0of1", "ab" * 16).to_json())
            check = commit_check(client, 0, it, list(range(executors)))
            t0 = time.perf_counter()
            assert check()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3
    finally:
        srv.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e5,1e6,4e6,1.6e7", help="parameters per shard, comma-separated")
    ap.add_argument("--coverage", default="1,0.25", help="shares of each tensor a fingerprint reads")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--executors", default="2,8,32")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as a worker runs
    load = os.getloadavg()[0]
    rows = []
    shares = [float(c) for c in args.coverage.split(",")]
    print(f"fingerprint of a shard (parameters + 2 AdamW moments), {args.dtype} on {args.device}; "
          f"load average {load:.1f} on {os.cpu_count()} cores")
    print(f"{'parameters':>12} {'coverage':>8} {'MB read':>9} {'ms':>8} {'GB/s':>7} {'% of 0.5 s':>11} "
          f"{'AdamW ms':>9} {'/ AdamW':>8}")
    for s in args.sizes.split(","):
        n = int(float(s))
        step = adamw_ms(n, args.dtype, args.device)
        size = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        for share in shares:
            ms = digest_ms(n, args.dtype, args.device, share)
            mb = 3 * n * size * share / 1e6
            rows.append({"name": f"fingerprint of {n:,} parameters at coverage {share:g}", "parameters": n,
                         "coverage": share, "mb": mb, "ms": ms, "share": ms / 1e3 / ITERATION_S, "adamw_ms": step})
            print(f"{n:>12,} {share:>8g} {mb:>9.1f} {ms:>8.2f} {mb / ms:>7.2f} "
                  f"{100 * ms / 1e3 / ITERATION_S:>10.2f}% {step:>9.2f} {ms / step:>8.2f}")
        ms = grad_norm_ms(n, args.dtype, args.device)
        rows.append({"name": f"range signal (gradient norm) of {n:,} parameters", "parameters": n, "ms": ms,
                     "share": ms / 1e3 / ITERATION_S, "adamw_ms": step})
        print(f"{n:>12,} {'norm':>8} {n * size / 1e6:>9.1f} {ms:>8.2f} {n * size / 1e6 / ms:>7.2f} "
              f"{100 * ms / 1e3 / ITERATION_S:>10.2f}% {step:>9.2f} {ms / step:>8.2f}")
    print(f"\n{'executors':>12} {'check ms':>9} {'% of 0.5 s':>11}   (last executor, over TCP)")
    for e in args.executors.split(","):
        ms = check_ms(int(e))
        rows.append({"name": f"comparison of {int(e)} executors", "executors": int(e), "ms": ms,
                     "share": ms / 1e3 / ITERATION_S})
        print(f"{int(e):>12} {ms:>9.2f} {100 * ms / 1e3 / ITERATION_S:>10.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "device": args.device, "load": load, "cores": os.cpu_count(),
                       "iteration_s": ITERATION_S, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
