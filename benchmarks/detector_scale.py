"""The fail-slow detector's CPU per iteration against the job's ranks (issue 34).

Why: the controller runs the detector on every committed iteration's profiles, one per
rank; what it costs per iteration at thousands of ranks decides whether the controller
keeps up with 1 s iterations. This runs the real :class:`WorkloadAwareDetector` (its
default change-point detector and verifier) in one process on synthetic profiles:
``executors`` data-parallel replicas of one stage, each a TP group of ``tp`` ranks
running the same 4 micro-batches of random documents at healthy speed, with 2 % noise.
After the warm-up (the model's fit) it times ``observe`` with the process CPU clock
over the last ``--measured`` iterations and prints the median per layout, with the
other figures of the table: ranks, executors, TP degree. No fault: the steady cost.

    python benchmarks/detector_scale.py [--layouts 128x8,512x8,2048x8,1024x1,4096x1] [--iterations 14]
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


def profiles(executors: int, tp: int, iteration: int, rng: random.Random) -> dict[int, IterationProfile]:
    """One iteration: every rank of an executor runs its 4 micro-batches (the same
    documents across the TP group), about 0.3 s of compute each with 2 % noise."""
    out: dict[int, IterationProfile] = {}
    for r in range(executors):
        mbs = []
        for j in range(4):
            docs = tuple(rng.randint(16, 512) for _ in range(4))
            t = 0.3 / 12 * (sum(docs) + sum(x * x for x in docs) / 1024) / 1400
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
    cpu: list[float] = []
    kinds: list[str] = []
    for it in range(iterations):
        ps = profiles(executors, tp, it, rng)  # made outside the timed call
        t = time.process_time()
        d = det.observe(it, ps)
        cpu.append(time.process_time() - t)
        kinds.append(d.action)
    last = cpu[-measured:]
    return {"ranks": executors * tp, "executors": executors, "tp": tp, "iterations": iterations,
            "cpu_s_per_iteration": round(statistics.median(last), 4), "cpu_s_measured": [round(x, 4) for x in last],
            "actions_measured": kinds[-measured:], "reports": sum(k == "reported" for k in kinds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="128x8,512x8,2048x8,1024x1,4096x1",
                    help="comma-separated executors x TP degree (default 128x8,512x8,2048x8,1024x1,4096x1)")
    ap.add_argument("--iterations", type=int, default=14, help="iterations per layout, warm-up included")
    ap.add_argument("--measured", type=int, default=4, help="last iterations timed (default 4)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    layouts = []
    for item in a.layouts.split(","):
        e, _, t = item.strip().partition("x")
        if not (e.isdigit() and t.isdigit() and int(e) >= 2 and int(t) >= 1):
            ap.error(f"--layouts: {item!r} is not <executors>x<tp> with executors >= 2")
        layouts.append((int(e), int(t)))
    if not 1 <= a.measured < a.iterations:
        ap.error("--measured must be at least 1 and below --iterations (the warm-up comes first)")
    t0, load0 = time.time(), loadavg()
    rows = []
    print("| ranks | executors | TP | detector CPU s per iteration (median of the last) | reports |")
    print("| --- | --- | --- | --- | --- |")
    for e, t in layouts:
        r = run(e, t, a.iterations, a.measured)
        rows.append(r)
        print(f"| {r['ranks']:,} | {e:,} | {t} | {r['cpu_s_per_iteration']:.3f} | {r['reports']} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps({
            "command": "python benchmarks/detector_scale.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "machine": machine(),
            "load": [load0, loadavg()], "wall_s": round(time.time() - t0, 1), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
