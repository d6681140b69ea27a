"""What a checkpoint costs: bytes, the time the training thread pays (the copy handed to
the background writer), the writer's time (serialise, write, fsync, read back and
verify), and the controller's time to verify a checkpoint before a restore.

    benchmarks/checkpoint.py [--quick] [--runs N] [--json PATH]

For the reference backend's model at several widths (4 layers, float32, parameters and
both AdamW moments, i.e. what ``megatron_ref`` writes for TP1 x PP1), median of
``--runs`` runs, with the load average next to it. It exits non-zero if a checkpoint
did not verify.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(hidden: int, runs: int, root: Path) -> dict:
    import torch

    from resihp_core import checkpoints
    from resihp_adapters.megatron_ref.model import ModelConfig, build_model
    from resihp_adapters.megatron_ref.state import component_of
    from resihp_adapters.torchkit.checkpoint import CheckpointWriter

    cfg = ModelConfig(vocab_size=1024, hidden=hidden, num_heads=4, ffn_hidden=4 * hidden, num_layers=4,
                      dtype="float32")
    net = build_model(cfg)
    state = {n: (p.detach(), torch.randn_like(p), torch.rand_like(p)) for n, p in net.named_parameters()}
    comps = sorted({component_of(n) for n in state})
    writer = CheckpointWriter(root, keep=2)
    copy_s, write_s, verify_s, nbytes = [], [], [], 0
    for it in range(runs):
        t0 = time.perf_counter()  # what save_checkpoint does on the training thread
        full: dict = {}
        for name, ts in state.items():
            full.setdefault(component_of(name), {})[name] = tuple(t.clone() for t in ts)
        writer.submit(it, full, comps)
        copy_s.append(time.perf_counter() - t0)
        if not writer.drain(300):
            raise RuntimeError("checkpoint write did not finish in 300 s")
        (res,) = writer.results()
        if res.error:
            raise RuntimeError(f"checkpoint write failed: {res.error}")
        write_s.append(res.seconds)
        nbytes = res.bytes
        t0 = time.perf_counter()
        if not checkpoints.verify(root, it).complete:
            raise RuntimeError(f"checkpoint {it} did not verify")
        verify_s.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in net.parameters())
    return dict(hidden=hidden, parameters=params, bytes=nbytes, components=len(comps),
                copy_ms=statistics.median(copy_s) * 1e3, write_ms=statistics.median(write_s) * 1e3,
                verify_ms=statistics.median(verify_s) * 1e3,
                write_mb_s=nbytes / statistics.median(write_s) / 1e6, runs=runs)


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
    rows = []
    try:
        for h in widths:
            with tempfile.TemporaryDirectory(prefix="resihp-ckpt-bench-") as tmp:
                rows.append(measure(h, runs, Path(tmp)))
    except RuntimeError as e:
        print(f"could not measure: {e}", file=sys.stderr)
        return 1
    load = open("/proc/loadavg").read().split()[:3]
    print(f"checkpoint cost, median of {runs} runs (load average {' '.join(load)})")
    print(f"{'hidden':>7} {'params':>10} {'bytes':>12} {'copy ms':>9} {'write ms':>9} {'MB/s':>7} {'verify ms':>10}")
    for r in rows:
        print(f"{r['hidden']:>7} {r['parameters']:>10} {r['bytes']:>12} {r['copy_ms']:>9.2f} {r['write_ms']:>9.1f} "
              f"{r['write_mb_s']:>7.1f} {r['verify_ms']:>10.1f}")
    print("copy: paid by the training thread; write: background thread (serialise, fsync, read back, "
          "verify); verify: the controller, before a restore")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, loadavg=load), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
