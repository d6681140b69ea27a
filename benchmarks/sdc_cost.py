"""What silent-data-corruption checks cost per iteration (docs/sdc.md, "Cost"): the
worker's fingerprint of its shard (parameters and two AdamW moments) for shards of
several sizes: every byte of both every iteration; the default (the parameters whole,
a rotating 1/R of the moments, ``RESIHP_SDC_STATE_ROUNDS``); and partial coverage of
everything (``RESIHP_SDC_COVERAGE``); the range signal (the norm of the shard's
gradient); and the comparison the last executor runs before its verdict (reading every
executor's fingerprint from the job store over TCP), each as a share of a 0.5 s
iteration; and, for the largest shard, how fast other reductions read the same
parameters. Prints a table and writes JSON.

With ``--job`` it instead runs one of overhead.py's jobs with fingerprints on and off
(``RESIHP_SDC=0``), alternating, and prints the difference in wall and CPU per iteration.

Usage: python benchmarks/sdc_cost.py [--sizes 1e6,4e6,1.6e7] [--rounds 1,4,8] [--coverage 0.25,0.1]
       [--tensors 16] [--dtype float32] [--device cpu|cuda] [--executors 2,8,32] [--json PATH]
       python benchmarks/sdc_cost.py --job dp4 [--size m] [--job-rounds 3] [--iterations 14] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ITERATION_S = 0.5  # the bar: <= 1 % of an iteration of at least this long


def _interleaved_ms(ways: dict[str, Callable[[int], object]], device: str, repeats: int) -> dict[str, float]:
    """Median milliseconds of each of ``ways`` (called with the repeat's number), the
    ways taking turns within each repeat, so that a burst of load elsewhere on a shared
    host falls on all of them alike rather than on whichever ran then."""
    import torch

    for fn in ways.values():
        fn(0)  # warm-up (allocator, kernels)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(repeats):
        for name, fn in ways.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(rep)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)  # a digest ends with a copy to the host anyway
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def digests_ms(params: int, dtype: str, device: str, reads: list[tuple[float, int]], tensors: int = 16,
               repeats: int = 15) -> dict[tuple[float, int], float]:
    """Median milliseconds of one fingerprint of a shard of ``params`` parameters held
    as ``tensors`` named tensors, with its two AdamW moments, for each ``(share, rounds)`` of
    ``reads``: ``share`` of each parameter tensor and ``1/rounds`` of each moment (the
    windows turning each repeat, as iterations turn them)."""
    import torch

    from resihp_core.detector.sdc import tensor_digest

    dt = getattr(torch, dtype)
    per = max(1, params // tensors)
    ps = [(f"p.layer{i}", torch.randn(per, dtype=dt, device=device)) for i in range(tensors)]
    state = [(f"{k}.layer{i}", torch.randn(per, dtype=dt, device=device)) for i in range(tensors) for k in "mv"]

    def way(share: float, rounds: int) -> Callable[[int], object]:
        return lambda turn: tensor_digest(ps, share=share, turn=turn, state=state, rounds=rounds)

    got = _interleaved_ms({f"{share} {rounds}": way(share, rounds) for share, rounds in reads}, device, repeats)
    return {(share, rounds): got[f"{share} {rounds}"] for share, rounds in reads}


def snapshot_fused_ms(params: int, dtype: str, device: str, rounds: int = 8, tensors: int = 16,
                      repeats: int = 15) -> dict[str, float]:
    """Median milliseconds of the rollback snapshot's copy of a shard (parameters and two
    moments) alone, with the default fingerprint as a separate pass after it, and with
    the fingerprint read during the copy (``copy_with_sums``: what a torch_native worker
    does with its overlapped commit, docs/sdc.md "What it costs")."""
    import torch

    from resihp_core.detector.sdc import copy_with_sums, digest_windows, seal, window_sum

    dt = getattr(torch, dtype)
    per = max(1, params // tensors)
    ps = [(f"p.layer{i}", torch.randn(per, dtype=dt, device=device)) for i in range(tensors)]
    state = [(f"{k}.layer{i}", torch.randn(per, dtype=dt, device=device)) for i in range(tensors) for k in "mv"]
    srcs = [t for _, t in ps + state]
    dsts = [torch.empty_like(t) for t in srcs]

    def separate(turn: int) -> None:
        torch._foreach_copy_(dsts, srcs)
        labels, views = digest_windows(ps, turn=turn, state=state, rounds=rounds)
        seal(labels, [window_sum(v) for v in views])

    def fused(turn: int) -> None:
        labels, views = digest_windows(ps, turn=turn, state=state, rounds=rounds)
        seal(labels, copy_with_sums(dsts, srcs, views))

    return _interleaved_ms({"copy": lambda turn: torch._foreach_copy_(dsts, srcs), "separate": separate,
                            "fused": fused}, device, repeats)


def job_ab(job_name: str, size: str, rounds: int, iterations: int) -> list[dict]:
    """The same fault-free job with fingerprints on (the default) and off
    (``RESIHP_SDC=0``), alternating within each round: what the fingerprint costs a
    real iteration on this host, wall and CPU of all the job's processes."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tempfile
    from pathlib import Path

    import overhead
    import peers

    peers.MODEL = dict(overhead.SIZES[size])
    job = peers.JOBS[job_name]
    root = tempfile.mkdtemp(prefix="resihp-sdc-ab-")
    runs = []
    for rnd in range(rounds):
        for mode in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            saved = os.environ.pop("RESIHP_SDC", None)
            if mode == "off":
                os.environ["RESIHP_SDC"] = "0"
            try:
                r = overhead.one_run("resihp", job, iterations, Path(root), 900.0)
            finally:
                os.environ.pop("RESIHP_SDC", None)
                if saved is not None:
                    os.environ["RESIHP_SDC"] = saved
            r.update(mode=mode, round=rnd)
            runs.append(r)
            print(f"{job_name} {size} round {rnd} fingerprints {mode}: {r['iteration_s']:.4f} s/it, "
                  f"{r['cpu_s_per_iteration']:.4f} CPU s/it (load {r['load'][1][0]:.1f}, outside "
                  f"{r['outside_cores']:.2f} cores)", flush=True)
    return runs


def read_alternatives_ms(params: int, dtype: str, device: str, repeats: int = 15) -> dict[str, float]:
    """Median milliseconds of reading one shard's parameters (16 tensors) each way a
    checksum could read them, the fingerprint's first: whether another reduction torch
    or numpy runs reads memory faster. Only the int64 sum is exact and order-free on
    every device; the float sum and norm are there for the bandwidth they reach."""
    import torch

    dt = getattr(torch, dtype)
    ts = [torch.randn(max(2, params // 16) // 2 * 2, dtype=dt, device=device) for _ in range(16)]
    ways = {
        "int64 words, torch sum (tensor_digest)": lambda: [t.view(torch.int64).sum() for t in ts],
        "int32 words widened to int64": lambda: [t.view(torch.int32).sum(dtype=torch.int64) for t in ts],
        "int64 words in 2-D, column sums first": lambda: [t.view(torch.int64).view(-1, 1 if t.numel() % 16 else 8)
                                                          .sum(0).sum() for t in ts],
        "float sum (not exact)": lambda: [t.sum() for t in ts],
        "foreach norm (not exact)": lambda: torch._foreach_norm(ts),
    }
    if device == "cpu":
        ways["int64 words, numpy sum"] = lambda: [t.numpy().view("i8").sum() for t in ts]
    return _interleaved_ms({name: (lambda rep, fn=fn: fn()) for name, fn in ways.items()}, device, repeats)


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
    ap.add_argument("--sizes", default="1e6,4e6,1.6e7", help="parameters per shard, comma-separated")
    ap.add_argument("--rounds", default="1,4,8",
                    help="parameters whole, the moments read once in this many iterations (1: all of both)")
    ap.add_argument("--coverage", default="0.25,0.1",
                    help="shares of every tensor a fingerprint reads (parameters and moments alike)")
    ap.add_argument("--tensors", type=int, default=16,
                    help="tensors the parameters are held in (as many of each moment): what each call costs")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--executors", default="2,8,32")
    ap.add_argument("--job", help="instead: overhead.py's job (dp4, pp2dp2, tp2pp2) with fingerprints on and off")
    ap.add_argument("--size", default="m", help="with --job: overhead.py's model size (default m)")
    ap.add_argument("--job-rounds", type=int, default=3, help="with --job: alternating rounds (default 3)")
    ap.add_argument("--iterations", type=int, default=14, help="with --job: iterations per run (default 14)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.job:
        return _job_main(args)
    import torch

    torch.set_num_threads(1)  # as a worker runs
    load = os.getloadavg()[0]
    rows = []
    # (share of each parameter tensor, rounds of the moments) as resihp_core.detector.sdc.windows sets them
    reads = [(1.0, int(r)) for r in args.rounds.split(",") if r]
    reads += [(float(c), math.ceil(1 / float(c))) for c in args.coverage.split(",") if c]
    print(f"fingerprint of a shard (parameters + 2 AdamW moments, {args.tensors} tensors each), "
          f"{args.dtype} on {args.device}; "
          f"load average {load:.1f} on {os.cpu_count()} cores")
    print(f"{'parameters':>12} {'params':>7} {'moments':>8} {'MB read':>9} {'ms':>8} {'GB/s':>7} {'% of 0.5 s':>11} "
          f"{'AdamW ms':>9} {'/ AdamW':>8}")
    for s in args.sizes.split(","):
        n = int(float(s))
        step = adamw_ms(n, args.dtype, args.device)
        size = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        got = digests_ms(n, args.dtype, args.device, reads, args.tensors)
        for share, rounds in reads:
            ms = got[(share, rounds)]
            mb = n * size * (share + 2 / rounds) / 1e6
            what = "every byte" if (share, rounds) == (1.0, 1) else (
                f"parameters whole, moments in {rounds} iterations" if share == 1.0 else f"coverage {share:g}")
            rows.append({"name": f"fingerprint of {n:,} parameters, {what}", "parameters": n,
                         "coverage": share, "rounds": rounds, "mb": mb, "ms": ms, "share": ms / 1e3 / ITERATION_S,
                         "adamw_ms": step})
            print(f"{n:>12,} {share:>7g} {'1/' + str(rounds):>8} {mb:>9.1f} {ms:>8.2f} {mb / ms:>7.2f} "
                  f"{100 * ms / 1e3 / ITERATION_S:>10.2f}% {step:>9.2f} {ms / step:>8.2f}")
        ms = grad_norm_ms(n, args.dtype, args.device)
        rows.append({"name": f"range signal (gradient norm) of {n:,} parameters", "parameters": n, "ms": ms,
                     "share": ms / 1e3 / ITERATION_S, "adamw_ms": step})
        print(f"{n:>12,} {'norm':>16} {n * size / 1e6:>9.1f} {ms:>8.2f} {n * size / 1e6 / ms:>7.2f} "
              f"{100 * ms / 1e3 / ITERATION_S:>10.2f}% {step:>9.2f} {ms / step:>8.2f}")
    n = int(float(args.sizes.split(",")[-1]))
    snap = snapshot_fused_ms(n, args.dtype, args.device, tensors=args.tensors)
    print(f"\nthe rollback snapshot's copy of {n:,} parameters and 2 moments: {snap['copy']:.2f} ms alone, "
          f"{snap['separate']:.2f} ms with the default fingerprint after it, {snap['fused']:.2f} ms with it read "
          f"during the copy")
    for way, extra in (("a separate pass after the snapshot's copy", snap["separate"] - snap["copy"]),
                       ("read during the snapshot's copy", snap["fused"] - snap["copy"])):
        rows.append({"name": f"fingerprint of {n:,} parameters, default, {way} (over the copy alone)",
                     "parameters": n, "ms": extra, "copy_ms": snap["copy"], "share": extra / 1e3 / ITERATION_S})
        print(f"{way:>42} {extra:>8.2f} ms over the copy, {100 * extra / 1e3 / ITERATION_S:.2f}% of 0.5 s")
    mb = n * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size() / 1e6
    print(f"\nreading the parameters of {n:,} ({mb:.1f} MB) each way")
    for way, ms in read_alternatives_ms(n, args.dtype, args.device).items():
        rows.append({"name": f"read {n:,} parameters: {way}", "parameters": n, "mb": mb, "ms": ms,
                     "share": ms / 1e3 / ITERATION_S})
        print(f"{way:>42} {ms:>8.2f} ms {mb / ms:>7.2f} GB/s")
    print(f"\n{'executors':>12} {'check ms':>9} {'% of 0.5 s':>11}   (last executor, over TCP)")
    for e in args.executors.split(","):
        ms = check_ms(int(e))
        rows.append({"name": f"comparison of {int(e)} executors", "executors": int(e), "ms": ms,
                     "share": ms / 1e3 / ITERATION_S})
        print(f"{int(e):>12} {ms:>9.2f} {100 * ms / 1e3 / ITERATION_S:>10.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "device": args.device, "tensors": args.tensors, "load": load, "cores": os.cpu_count(),
                       "iteration_s": ITERATION_S, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


def _job_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import machine

    t0 = time.time()
    runs = job_ab(args.job, args.size, args.job_rounds, args.iterations)
    ok = [r for r in runs if r["ok"]]
    med = {m: {k: statistics.median(r[k] for r in ok if r["mode"] == m) for k in ("iteration_s", "cpu_s_per_iteration")}
           for m in ("on", "off") if any(r["mode"] == m for r in ok)}
    rows = []
    if len(med) == 2:
        for k, what in (("iteration_s", "wall s/it"), ("cpu_s_per_iteration", "CPU s/it")):
            on, off = med["on"][k], med["off"][k]
            rows.append({"name": f"{args.job} {args.size}: {what}", "on": on, "off": off,
                         "share": (on - off) / off})
            print(f"{args.job} {args.size} {what}: fingerprints on {on:.4f}, off {off:.4f}: "
                  f"{100 * (on - off) / off:+.2f} %")
    failed = [r["error"] for r in runs if not r["ok"]]
    if failed:
        print("failed runs: " + "; ".join(str(e)[:200] for e in failed))
    if args.json:
        with open(args.json, "w") as f:
            loads = [x for r in runs for x in (r["load"][0] or [None])[:1] + (r["load"][1] or [None])[:1]
                     if x is not None]
            json.dump({"command": "python benchmarks/sdc_cost.py " + " ".join(sys.argv[1:]),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "machine": machine(),
                       "load": [min(loads), max(loads)] if loads else None, "wall_s": round(time.time() - t0, 1),
                       "job": args.job, "size": args.size, "rounds": args.job_rounds, "iterations": args.iterations,
                       "cores": os.cpu_count(), "rows": rows, "runs": runs}, f, indent=1)
    return 0 if len(med) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
