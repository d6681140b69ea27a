"""How fast the soak's fault-free float64 trajectory amplifies a rounding-level difference.

The soak (`benchmarks/soak.py`) compares a job's checkpoints with a fault-free float64
reference started from an earlier checkpoint, and a run that adds gradients in another
order differs from it by rounding. This script asks whether that difference can explain
a failed check: it perturbs the reference's weights by 1e-15 (relative) at several
iterations and prints the relative parameter difference over the next 45 iterations.
A check that fails by far more than this growth allows is not rounding.

    python benchmarks/soak_sensitivity.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

STARTS = (20, 60, 100, 140, 200, 280, 360, 410)
SPAN = 45


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the growth table here")
    args = ap.parse_args(argv)
    import torch

    import soak
    from resihp_adapters.megatron_ref.adapter import data_spec, model_config
    from resihp_adapters.megatron_ref.reference import reference_trajectory
    from resihp_core.config import Config
    from resihp_core.runtime.jobs import build_job

    torch.set_num_threads(1)
    n = max(STARTS) + SPAN + 1
    cfg = Config.from_dict(dict(soak.CONFIG, training=dict(soak.CONFIG["training"], iterations=n)),
                           source="soak_sensitivity")
    spec = build_job(cfg, [], Path(tempfile.mkdtemp(prefix="resihp-sens-"))).spec
    model, data, lr = model_config(spec), data_spec(spec), float(spec.adapter_config["lr"])
    states = {it: st for it, _, st in reference_trajectory(model, data, n, lr=lr)}
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'perturbed at':>12} " + " ".join(f"{'+' + str(d):>8}" for d in range(5, SPAN + 1, 5)))
    for s in STARTS:
        pert = {k: (p * (1 + 1e-15 * torch.randn(p.shape, generator=gen, dtype=p.dtype)), m, v)
                for k, (p, m, v) in states[s].items()}
        growth = {}
        for it, _, st in reference_trajectory(model, data, s + SPAN + 1, lr=lr, start=s + 1, state=pert):
            num = math.sqrt(sum(float(((st[k][0] - states[it][k][0]) ** 2).sum()) for k in st))
            den = math.sqrt(sum(float((states[it][k][0] ** 2).sum()) for k in st))
            growth[it - s] = num / den
        rows.append({"start": s, "relative_difference": growth})
        print(f"{s:>12} " + " ".join(f"{growth[d]:8.1e}" for d in range(5, SPAN + 1, 5)))
    worst = max(max(r["relative_difference"].values()) for r in rows)
    print(f"largest relative difference {SPAN} iterations after a 1e-15 perturbation: {worst:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "worst": worst}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
