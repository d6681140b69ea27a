"""Accuracy of the micro-batch time predictor T = α·N + β·Σ l_i² (docs/design.md §3.3, §7).

Runs real forward/backward passes of the reference LLaMA-style block stack (TP 1, one
process, one CPU thread) on packed variable-length micro-batches drawn from a
long-tailed synthetic corpus, fits α and β (forward and backward separately) on a
warm-up set, and reports the MAPE of predictions on held-out micro-batches.

Measurement discipline (the machine is shared with other jobs):

* a few discarded passes first (allocator and kernel warm-up);
* every micro-batch is measured ``--repeats`` times in interleaved, shuffled rounds so
  slow spells hit all micro-batches alike, and the median per micro-batch is used;
  micro-batches whose median is still uncertain (standard error above
  ``--target-se-pct``) are measured again, up to ``--max-repeats``;
* the primary clock is the thread's CPU time (one intra-op thread, so all the work runs
  on this thread): it excludes the spells when other tenants hold the core. Wall-clock
  results are reported next to it.

* the process is pinned to one CPU (no migration inside a timed pass).

The truth must be more precise than the target it judges: next to every MAPE the
benchmark reports the noise floor of the held-out measurement, from the standard error
of each held-out micro-batch's median (MAD-based). A perfect model would still score a
MAPE of about sqrt(2/π) times the RMS of those errors (the "noise floor"); the floor
should be below 1 % to judge a 2 % target, and the model's own error is estimated as
sqrt(MAPE² - floor²) ("beyond floor").

Scored on held-out micro-batches: the two-term model (docs/design.md §3.3) α·N + β·Σl², the same with
a per-document term δ·D (this backend launches attention once per document), and a
"naive" predictor that ignores document lengths (the mean warm-up time; every
micro-batch has the same N).

    python benchmarks/predictor_accuracy.py [--quick] [--json PATH]

Exits 1 if it could not measure (or fit); the ≤ 2 % target is reported, not enforced.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from resihp_adapters.megatron_ref.model import ModelConfig, build_stage  # noqa: E402
from resihp_core.predictor.corpus import CorpusSpec, packed_microbatches, sum_sq  # noqa: E402
from resihp_core.predictor.cost import CostModelError, fit_stage, mape  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchstats import floor_corrected, machine  # noqa: E402

TARGET_PCT = 2.0
FLOOR_TARGET_PCT = 1.0  # the truth must be more precise than the target it judges


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run (about 1 min)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--tokens", type=int, help="token budget N per micro-batch")
    ap.add_argument("--hidden", type=int, help="hidden size")
    ap.add_argument("--layers", type=int, help="decoder layers in the stage")
    ap.add_argument("--warmup-mbs", type=int, help="micro-batches used to fit α, β")
    ap.add_argument("--test-mbs", type=int, help="held-out micro-batches scored")
    ap.add_argument("--repeats", type=int, help="measurements of every micro-batch (median)")
    ap.add_argument("--max-repeats", type=int, help="cap for noisy micro-batches")
    ap.add_argument("--target-se-pct", type=float,
                    help="re-measure a micro-batch while its median's standard error exceeds this")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _settings(a: argparse.Namespace) -> dict[str, float]:
    base = (
        dict(tokens=1024, hidden=128, layers=1, warmup_mbs=12, test_mbs=12, repeats=5,
             max_repeats=25, target_se_pct=0.35)
        if a.quick
        else dict(tokens=2048, hidden=128, layers=2, warmup_mbs=32, test_mbs=32, repeats=7,
                  max_repeats=25, target_se_pct=0.4)
    )
    for k in base:
        if getattr(a, k) is not None:
            base[k] = getattr(a, k)
    return base


def _time_pass(
    stage: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, lengths: tuple[int, ...]
) -> tuple[float, float, float, float]:
    """(forward, backward) seconds as thread CPU time, then as wall-clock time.

    With one intra-op thread all the work runs on this thread (the CPU autograd engine
    runs the backward on the calling thread), so its CPU time is the pass's compute time
    minus the spells in which other tenants of this shared machine held the core.
    """
    xi = x.detach().requires_grad_()
    gc.collect()
    w0, c0 = time.perf_counter(), time.thread_time()
    y = stage(xi, lengths)
    w1, c1 = time.perf_counter(), time.thread_time()
    y.backward(grad)
    w2, c2 = time.perf_counter(), time.thread_time()
    return c1 - c0, c2 - c1, w1 - w0, w2 - w1


def _keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep freed blocks (no mmap per large tensor, no trimming):
    otherwise every pass maps fresh pages and pays their page faults, a few per cent of
    noise on identical work. Returns whether it took effect (False off glibc)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        big = 1 << 30
        return bool(libc.mallopt(m_mmap_threshold, big)) and bool(libc.mallopt(m_trim_threshold, big))
    except (OSError, AttributeError):
        return False


def _pin_one_cpu() -> int | None:
    """Keep this process on one CPU (the one it is on): no migrations between cores, whose
    caches it would refill, inside a timed pass. Returns the CPU, None where unsupported."""
    try:
        allowed = os.sched_getaffinity(0)
        with open("/proc/self/stat") as f:  # field 39: the CPU this process last ran on
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])
        os.sched_setaffinity(0, {cpu if cpu in allowed else min(allowed)})
        return cpu
    except (AttributeError, OSError, ValueError, IndexError):
        return None


def _median_rel_se(xs: list[float]) -> float:
    """Standard error of the median relative to it, from the median absolute deviation
    (normal approximation: 1.253 · 1.4826 · MAD / √n)."""
    m = statistics.median(xs)
    mad = statistics.median(abs(x - m) for x in xs)
    return 1.2533 * 1.4826 * mad / len(xs) ** 0.5 / m


def run(argv: list[str] | None = None) -> dict[str, object]:
    args = _parse(argv)
    cfg = _settings(args)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    pinned = _pin_one_cpu()
    kept = _keep_freed_memory()
    n, hidden, layers = int(cfg["tokens"]), int(cfg["hidden"]), int(cfg["layers"])
    heads = max(1, hidden // 64)
    model_cfg = ModelConfig(
        vocab_size=256, hidden=hidden, num_heads=heads, ffn_hidden=(8 * hidden // 3) // 16 * 16,
        num_layers=layers, dtype="float32", seed=args.seed,
    )
    corpus = CorpusSpec(
        distribution="lognormal", scale=n / 8, shape=1.2, min_len=32, max_len=4 * n,
        token_budget=n, seed=args.seed,
    )
    warm = packed_microbatches(corpus, int(cfg["warmup_mbs"]), stream="warmup")
    test = packed_microbatches(corpus, int(cfg["test_mbs"]), stream="heldout")
    mbs = warm + test

    stage = build_stage(model_cfg, (0, layers), False, False)
    x = torch.randn(n, hidden)
    grad = torch.randn(n, hidden)
    for lengths in packed_microbatches(corpus, 3, stream="discard"):
        _time_pass(stage, x, grad, lengths)

    # times[clock][i] = [(forward, backward), ...] over repeats of micro-batch i
    times: dict[str, list[list[tuple[float, float]]]] = {"cpu": [[] for _ in mbs], "wall": [[] for _ in mbs]}
    order = list(range(len(mbs)))
    shuffle = random.Random(args.seed)
    load_before = os.getloadavg()[0]
    gc_was = gc.isenabled()
    gc.disable()  # no collector pauses inside a timed pass (collected between passes)
    t_start = time.perf_counter()
    try:
        for rnd in range(int(max(cfg["max_repeats"], cfg["repeats"]))):
            # Every micro-batch gets `repeats` rounds; after that only those whose median
            # is still uncertain (noisy spells on the shared machine) are measured again.
            todo = order if rnd < cfg["repeats"] else [
                i for i in order
                if _median_rel_se([f + b for f, b in times["cpu"][i]]) > cfg["target_se_pct"] / 100
            ]
            if not todo:
                break
            shuffle.shuffle(todo)
            for i in todo:
                cf, cb, wf, wb = _time_pass(stage, x, grad, mbs[i])
                times["cpu"][i].append((cf, cb))
                times["wall"][i].append((wf, wb))
    finally:
        if gc_was:
            gc.enable()
    elapsed = time.perf_counter() - t_start

    k = len(warm)
    ssq = [sum_sq(l) for l in mbs]
    out: dict[str, object] = {}
    details: list[dict[str, object]] = [
        {"set": "warmup" if i < k else "heldout", "lengths": list(mbs[i]), "sum_sq": ssq[i]}
        for i in range(len(mbs))
    ]
    for clock, csuf in (("cpu", ""), ("wall", "_wall")):
        per_mb = times[clock]
        mf = [statistics.median(f for f, _ in t) for t in per_mb]
        mb = [statistics.median(b for _, b in t) for t in per_mb]
        tot = [statistics.median(f + b for f, b in t) for t in per_mb]
        if not all(v > 0 for v in mf + mb):
            raise RuntimeError(f"a measured {clock} time was not positive")
        # Noise: median relative deviation of one repeat from its micro-batch's median.
        noise = statistics.median(abs(f + b - m) / m for t, m in zip(per_mb, tot) for f, b in t)
        out[f"repeat_noise{csuf}_pct"] = 100 * noise
        # The noise floor of the held-out truth: each micro-batch's measured time is a
        # median of its repeats, with a relative standard error; a perfect model would
        # still show a MAPE of about sqrt(2/π) · (RMS of those errors).
        se = [_median_rel_se([f + b for f, b in t]) for t in per_mb[k:]]
        rms = (sum(x * x for x in se) / len(se)) ** 0.5
        out[f"heldout_se_rms{csuf}_pct"] = 100 * rms
        out[f"heldout_se_max{csuf}_pct"] = 100 * max(se)
        out[f"mape_floor{csuf}_pct"] = 100 * (2 / math.pi) ** 0.5 * rms
        out[f"measured_total_min{csuf}_s"] = min(tot)
        out[f"measured_total_max{csuf}_s"] = max(tot)
        out[f"mape_total_naive{csuf}_pct"] = mape([statistics.fmean(tot[:k])] * len(test), tot[k:])
        for i, d in enumerate(details):
            d.update({f"forward{csuf}_s": mf[i], f"backward{csuf}_s": mb[i],
                      f"repeats{csuf}_s": [list(fb) for fb in per_mb[i]]})
        # The docs/design.md's two-term model, then with the per-document term δ·D.
        for per_doc, msuf in ((False, ""), (True, "_perdoc")):
            suffix = msuf + csuf
            cost = fit_stage([(warm[i], mf[i], mb[i]) for i in range(k)], ref_layers=layers,
                             ref_tp=1, per_document=per_doc)
            pf = [cost.forward(l) for l in mbs]
            pb = [cost.backward(l) for l in mbs]
            pt = [f + b for f, b in zip(pf, pb)]
            out.update({
                f"mape_forward{suffix}_pct": mape(pf[k:], mf[k:]),
                f"mape_backward{suffix}_pct": mape(pb[k:], mb[k:]),
                f"mape_total{suffix}_pct": mape(pt[k:], tot[k:]),
                f"mape_total_fit{suffix}_pct": mape(pt[:k], tot[:k]),
                f"alpha_f{suffix}": cost.alpha_f,
                f"beta_f{suffix}": cost.beta_f,
                f"alpha_b{suffix}": cost.alpha_b,
                f"beta_b{suffix}": cost.beta_b,
            })
            if per_doc:
                out[f"delta_f{suffix}"] = cost.delta_f
                out[f"delta_b{suffix}"] = cost.delta_b
            elif clock == "cpu":
                out["attention_share_of_time"] = statistics.fmean(
                    (cost.beta_f + cost.beta_b) * s / t for s, t in zip(ssq, pt)
                )
            for i, d in enumerate(details):
                d.update({f"predicted_forward{suffix}_s": pf[i], f"predicted_backward{suffix}_s": pb[i]})
    for csuf in ("", "_wall"):
        for msuf in ("", "_perdoc"):
            out[f"mape_total{msuf}{csuf}_beyond_floor_pct"] = floor_corrected(
                out[f"mape_total{msuf}{csuf}_pct"], out[f"mape_floor{csuf}_pct"])  # type: ignore[arg-type]
    out["target_pct"] = TARGET_PCT
    out["floor_target_pct"] = FLOOR_TARGET_PCT
    out["meets_target"] = out["mape_total_pct"] <= TARGET_PCT  # type: ignore[operator]
    out["floor_below_target"] = out["mape_floor_pct"] < FLOOR_TARGET_PCT  # type: ignore[operator]
    out["sum_sq_min"], out["sum_sq_max"] = min(ssq), max(ssq)
    out["measure_elapsed_s"] = elapsed
    out["repeats_mean"] = statistics.fmean(len(t) for t in times["cpu"])
    out["microbatches"] = details
    out["config"] = {
        **cfg,
        "quick": args.quick,
        "seed": args.seed,
        "model": asdict(model_cfg),
        "corpus": asdict(corpus),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_1min_before": load_before,
        "loadavg_1min_after": os.getloadavg()[0],
        "primary_clock": "thread CPU time (time.thread_time)",
        "pinned_cpu": pinned,
        "allocator_keeps_freed_memory": kept,
        "machine": machine(),
    }
    return out


def _table(r: dict[str, object]) -> str:
    c = r["config"]
    assert isinstance(c, dict)

    def pct(key: str) -> str:
        return f"{r[key]:6.2f} %"

    rows = [
        ("held-out MAPE", "CPU time", "wall clock"),
        ("α·N + β·Σl²: forward", pct("mape_forward_pct"), pct("mape_forward_wall_pct")),
        ("α·N + β·Σl²: backward", pct("mape_backward_pct"), pct("mape_backward_wall_pct")),
        ("α·N + β·Σl²: total", pct("mape_total_pct"), pct("mape_total_wall_pct")),
        ("+ δ·docs: forward", pct("mape_forward_perdoc_pct"), pct("mape_forward_perdoc_wall_pct")),
        ("+ δ·docs: backward", pct("mape_backward_perdoc_pct"), pct("mape_backward_perdoc_wall_pct")),
        ("+ δ·docs: total", pct("mape_total_perdoc_pct"), pct("mape_total_perdoc_wall_pct")),
        ("naive (ignores lengths): total", pct("mape_total_naive_pct"), pct("mape_total_naive_wall_pct")),
        ("α·N + β·Σl², on warm-up: total", pct("mape_total_fit_pct"), pct("mape_total_fit_wall_pct")),
        ("repeat noise (median deviation)", pct("repeat_noise_pct"), pct("repeat_noise_wall_pct")),
        ("held-out truth: SE of median (RMS)", pct("heldout_se_rms_pct"), pct("heldout_se_rms_wall_pct")),
        ("noise floor of the MAPE", pct("mape_floor_pct"), pct("mape_floor_wall_pct")),
        ("α·N + β·Σl²: total beyond floor", pct("mape_total_beyond_floor_pct"),
         pct("mape_total_wall_beyond_floor_pct")),
        ("+ δ·docs: total beyond floor", pct("mape_total_perdoc_beyond_floor_pct"),
         pct("mape_total_perdoc_wall_beyond_floor_pct")),
        ("micro-batch time range (ms)",
         f"{r['measured_total_min_s'] * 1e3:.0f}-{r['measured_total_max_s'] * 1e3:.0f}",
         f"{r['measured_total_min_wall_s'] * 1e3:.0f}-{r['measured_total_max_wall_s'] * 1e3:.0f}"),
        ("α_f, β_f (s/token, s/token²)", f"{r['alpha_f']:.3e}, {r['beta_f']:.3e}",
         f"{r['alpha_f_wall']:.3e}, {r['beta_f_wall']:.3e}"),
        ("α_b, β_b (s/token, s/token²)", f"{r['alpha_b']:.3e}, {r['beta_b']:.3e}",
         f"{r['alpha_b_wall']:.3e}, {r['beta_b_wall']:.3e}"),
        ("δ_f, δ_b (s/document)", f"{r['delta_f_perdoc']:.2e}, {r['delta_b_perdoc']:.2e}",
         f"{r['delta_f_perdoc_wall']:.2e}, {r['delta_b_perdoc_wall']:.2e}"),
    ]
    widths = [max(len(row[j]) for row in rows) for j in range(3)]
    head = (
        f"predictor accuracy: N={c['tokens']} hidden={c['hidden']} layers={c['layers']} "
        f"warm-up={c['warmup_mbs']} held-out={c['test_mbs']} repeats={c['repeats']}-"
        f"{c['max_repeats']} (mean {r['repeats_mean']:.1f})"
    )
    lines = [head, "-" * len(head)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [
        f"attention share of predicted time: {100 * r['attention_share_of_time']:.0f} %, "
        f"Σ l² range {r['sum_sq_min']:,}-{r['sum_sq_max']:,}",
        f"target: total MAPE of α·N + β·Σl² <= {TARGET_PCT} % (CPU time): "
        + ("met" if r["meets_target"] else "NOT met")
        + f" ({r['mape_total_pct']:.2f} %, noise floor {r['mape_floor_pct']:.2f} %: "
        + ("below" if r["floor_below_target"] else "NOT below")
        + f" the {FLOOR_TARGET_PCT} % a judgement needs; model error beyond the floor "
        + f"{r['mape_total_beyond_floor_pct']:.2f} %)",
        f"measured in {r['measure_elapsed_s']:.0f} s; load average {c['loadavg_1min_before']:.1f} "
        f"-> {c['loadavg_1min_after']:.1f} on {c['cpu_count']} CPUs",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        result = run(argv)
    except (CostModelError, RuntimeError, ValueError) as e:
        print(f"predictor_accuracy: could not measure: {e}", file=sys.stderr)
        return 1
    print(_table(result))
    args = _parse(argv)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
