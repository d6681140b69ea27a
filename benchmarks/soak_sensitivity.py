"""How fast the soak's float64 training amplifies a rounding-level difference.

A degraded plan adds the same gradients in another order, so its run differs from the
fault-free reference by rounding every iteration. This script starts two reference runs
from the same state, one adding micro-batch gradients in the usual order and one in
reverse (:func:`reference_trajectory` ``reverse=True``), and prints how far apart they
are 5, 10, ... 45 iterations later: the worst relative difference over parameters and
AdamW state (the soak's metric) and the loss's.

The start states are the fault-free reference's own at several iterations, or, with
``--checkpoints DIR``, a soak's kept checkpoints (``benchmarks/soak.py --keep``): a
long job's trajectory drifts away from the reference's, into regions where the growth
can be far faster. This is why the soak verifies one iteration at a time.

    python benchmarks/soak_sensitivity.py [--checkpoints DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

STARTS = (20, 100, 200, 300, 400)
SPAN = 45


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", help="start from these checkpoints (a kept soak's work folder/checkpoints)")
    ap.add_argument("--json", help="write the growth table here")
    args = ap.parse_args(argv)
    import torch

    import soak
    from resihp_adapters.megatron_ref.reference import reference_trajectory
    from resihp_core import checkpoints

    torch.set_num_threads(1)
    s = soak.Soak(2, 0, Path(tempfile.mkdtemp(prefix="resihp-sens-")))
    model, data, lr = s.model, s.data, s.lr
    if args.checkpoints:
        s.ckpt = Path(args.checkpoints)
        kept = sorted(i.iteration for i in checkpoints.scan(s.ckpt) if i.complete)
        if not kept:
            ap.error(f"no complete checkpoint in {args.checkpoints}")
        starts = kept[:: max(1, len(kept) // 4)][:4]
        states = {k: s._load(k) for k in starts}
    else:
        starts = STARTS
        want = set(starts)
        states = {it: st for it, _, st in reference_trajectory(model, data, max(starts) + 1, lr=lr) if it in want}
    rows = []
    print(f"{'start':>6} " + " ".join(f"{'+' + str(d):>17}" for d in range(5, SPAN + 1, 5)))
    print(f"{'':>6} " + " ".join(f"{'state / loss':>17}" for _ in range(5, SPAN + 1, 5)))
    for k in starts:
        runs = [reference_trajectory(model, data, k + SPAN + 1, lr=lr, start=k + 1, state=states[k], reverse=r)
                for r in (False, True)]
        growth = {}
        for (it, la, sa), (_, lb, sb) in zip(*runs):
            growth[it - k] = (s._error(sb, sa)[0], abs(la - lb) / abs(la))
        rows.append({"start": k, "state_and_loss": growth})
        print(f"{k:>6} " + " ".join(f"{growth[d][0]:8.1e}/{growth[d][1]:8.1e}" for d in range(5, SPAN + 1, 5)),
              flush=True)
    first = {r["start"]: min((d for d, (e, _) in r["state_and_loss"].items() if e > soak.TOL), default=None)
             for r in rows}
    print("iterations until the state differs by more than the soak's tolerance "
          f"({soak.TOL}): " + ", ".join(f"from {k}: {'>' + str(SPAN) if d is None else d}" for k, d in first.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "first_over_tolerance": first}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
