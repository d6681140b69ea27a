"""The fail-slow detector's CPU per iteration against the job's ranks (issue 34).

Why: the controller runs the detector on every committed iteration's profiles, one per
rank; what it costs per iteration at thousands of ranks decides whether the controller
keeps up with 1 s iterations. This runs the real :class:`WorkloadAwareDetector` (its
default change-point detector and verifier) in one process on synthetic profiles:
``executors`` data-parallel replicas of one stage, each a TP group of ``tp`` ranks
running the same 4 micro-batches of random documents, with 2 % noise. After the warm-up
(the model's fit) it times ``observe`` with the process CPU clock: the median over the
``--measured`` healthy iterations before the onset, then executor 0 (its whole TP group)
computes 2x from iteration ``iterations - 6`` on: the iterations until it is reported
(from its first slowed one), whether it is the one reported, and the CPU of the
iteration that verified it.

    python benchmarks/detector_scale.py [--layouts 128x8,512x8,2048x8,1024x1,4096x1] [--iterations 20]
        [--measured 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchstats import loadavg, machine  # noqa: E402
from resihp_core.detector.changepoint import BOCPD  # noqa: E402
from resihp_core.detector.failslow import WorkloadAwareDetector  # noqa: E402
from resihp_core.detector.verify import ProfileVerifier  # noqa: E402
from resihp_core.protocol import IterationProfile, MicroBatchProfile  # noqa: E402


def profiles(executors: int, tp: int, iteration: int, rng: random.Random,
             slow: float = 1.0) -> dict[int, IterationProfile]:
    """One iteration: every rank of an executor runs its 4 micro-batches (the same
    documents across the TP group), about 0.3 s of compute each with 2 % noise; executor
    0 computes ``slow`` times as long."""
    out: dict[int, IterationProfile] = {}
    for r in range(executors):
        mbs = []
        for j in range(4):
            docs = tuple(rng.randint(16, 512) for _ in range(4))
            t = 0.3 / 12 * (sum(docs) + sum(x * x for x in docs) / 1024) / 1400 * (slow if r == 0 else 1.0)
            mbs.append((r, j, docs, t))
        for k in range(tp):
            d = r * tp + k
            chunks = []
            for o, j, docs, t in mbs:
                e = rng.lognormvariate(0.0, 0.02)
                chunks.append(MicroBatchProfile(owner=o, mb=j, forward_s=t * e, backward_s=2 * t * e,
                                                doc_lengths=docs))
            comp = sum(c.forward_s + c.backward_s for c in chunks)
            out[d] = IterationProfile(rank=d, device=d, generation=0, iteration=iteration, stage=0, replica=r,
                                      microbatches=tuple(chunks), comm_s=0.05, iteration_s=comp + 0.05,
                                      cpus=(d,))
    return out


def run(executors: int, tp: int, iterations: int, measured: int) -> dict:
    rng = random.Random(executors * 100 + tp)
    det = WorkloadAwareDetector(BOCPD(), ProfileVerifier(), clock=lambda: 0.0)
    onset = iterations - 6
    cpu: list[float] = []
    reported: tuple[int, list[int]] | None = None
    for it in range(iterations):
        ps = profiles(executors, tp, it, rng, 2.0 if it >= onset else 1.0)  # made outside the timed call
        t = time.process_time()
        d = det.observe(it, ps)
        cpu.append(time.process_time() - t)
        if it < onset and d.action == "reported":
            raise SystemExit(f"{executors}x{tp}: a healthy iteration ({it}) was reported: {d.notes}")
        if d.action == "reported" and reported is None:
            reported = (it, sorted(d.report.devices) if d.report is not None else [])
    healthy = cpu[onset - measured:onset]
    row = {"ranks": executors * tp, "executors": executors, "tp": tp, "iterations": iterations,
           "cpu_s_per_iteration": round(statistics.median(healthy), 4),
           "cpu_s_measured": [round(x, 4) for x in healthy],
           "onset": onset, "reported_at": None, "latency_iterations": None, "reported_devices": [],
           "right_devices": False, "verify_cpu_s": None}
    if reported is not None:
        it, devices = reported
        row.update(reported_at=it, latency_iterations=it - onset + 1, reported_devices=devices,
                   right_devices=devices == list(range(tp)), verify_cpu_s=round(cpu[it], 4))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="128x8,512x8,2048x8,1024x1,4096x1",
                    help="comma-separated executors x TP degree (default 128x8,512x8,2048x8,1024x1,4096x1)")
    ap.add_argument("--iterations", type=int, default=20,
                    help="iterations per layout, warm-up included; the slowdown starts 6 before the end")
    ap.add_argument("--measured", type=int, default=4, help="healthy iterations timed before the onset (default 4)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    layouts = []
    for item in a.layouts.split(","):
        e, _, t = item.strip().partition("x")
        if not (e.isdigit() and t.isdigit() and int(e) >= 2 and int(t) >= 1):
            ap.error(f"--layouts: {item!r} is not <executors>x<tp> with executors >= 2")
        layouts.append((int(e), int(t)))
    if a.iterations < 16 or not 1 <= a.measured <= a.iterations - 12:
        ap.error("--iterations must be at least 16 and --measured from 1 to iterations - 12 (warm-up and slowdown)")
    t0, load0 = time.time(), loadavg()
    rows = []
    print("| ranks | executors | TP | detector CPU s per healthy iteration | executor 0 at 2x: reported after | "
          "the right devices | CPU s of the verifying iteration |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for e, t in layouts:
        r = run(e, t, a.iterations, a.measured)
        rows.append(r)
        late = "not reported" if r["reported_at"] is None else f"{r['latency_iterations']} iterations"
        verify = "-" if r["verify_cpu_s"] is None else f"{r['verify_cpu_s']:.3f}"
        print(f"| {r['ranks']:,} | {e:,} | {t} | {r['cpu_s_per_iteration']:.3f} | {late} | "
              f"{'yes' if r['right_devices'] else 'no'} | {verify} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps({
            "command": "python benchmarks/detector_scale.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "machine": machine(),
            "load": [load0, loadavg()], "wall_s": round(time.time() - t0, 1), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
