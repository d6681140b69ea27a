"""benchmarks/overhead.py's figures from runs: per-round pairing, fixed cost, Young/Daly."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import overhead  # noqa: E402


def _run(system: str, rnd: int, s: float, ok: bool = True) -> dict:
    return {"system": system, "round": rnd, "ok": ok, "error": "" if ok else "boom", "iteration_s": s,
            "load": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], "outside_cores": 0.1 * (rnd + 1)}


def test_rounds_are_paired_and_failed_runs_left_out() -> None:
    times = [{"stock": 1.0, "resihp": 1.02, "stock+ckpt": 1.10, "resihp+ckpt": 1.03},
             {"stock": 2.0, "resihp": 2.10, "stock+ckpt": 2.20, "resihp+ckpt": 2.12}]
    runs = [_run(s, r, t) for r, ts in enumerate(times) for s, t in ts.items()]
    runs.append(_run("resihp", 2, 9.0, ok=False))  # a third round whose ResiHP run failed
    runs.append(_run("stock", 2, 0.1))
    f = overhead.figures(runs, mtbf_s=3600.0)
    over = [100 * (t["resihp"] / t["stock"] - 1) for t in times]  # paired within each round
    assert f["overhead_pct"]["median"] == pytest.approx(sum(over) / 2)
    assert (f["overhead_pct"]["min"], f["overhead_pct"]["max"]) == pytest.approx((min(over), max(over)))
    assert f["overhead_pct"]["n"] == 2
    fixed = [1000 * (t["resihp"] - t["stock"]) for t in times]
    assert f["fixed_ms_per_iteration"]["median"] == pytest.approx(sum(fixed) / 2)
    assert f["failed"] == ["resihp round 2: boom"]
    assert f["outside_cores_max"] == pytest.approx(0.3)
    # Young/Daly per system from its own checkpoint cost C = (X+ckpt) - X, per round.
    def k(plain: float, ckpt: float) -> int:
        return max(1, round(math.sqrt(2 * (ckpt - plain) * 3600) / plain))

    ks = sorted(k(t["stock"], t["stock+ckpt"]) for t in times)
    assert [f["young_daly_every"]["stock"][m] for m in ("min", "max")] == ks
    kr = sorted(k(t["resihp"], t["resihp+ckpt"]) for t in times)
    assert [f["young_daly_every"]["resihp"][m] for m in ("min", "max")] == kr
    t = times[0]
    c_s = t["stock+ckpt"] - t["stock"]
    k_s = k(t["stock"], t["stock+ckpt"])
    assert overhead.young_daly(t["stock"], t["stock+ckpt"], 3600.0) == pytest.approx((c_s, k_s, 1.0 + c_s / k_s))
    yd = []
    for t in times:
        ts = t["stock"] + (t["stock+ckpt"] - t["stock"]) / k(t["stock"], t["stock+ckpt"])
        tr = t["resihp"] + (t["resihp+ckpt"] - t["resihp"]) / k(t["resihp"], t["resihp+ckpt"])
        yd.append(100 * (tr / ts - 1))
    assert f["overhead_young_daly_pct"]["median"] == pytest.approx(sum(yd) / 2)

def test_a_checkpoint_that_costs_nothing_is_every_iteration() -> None:
    # Background writes that cost the iteration nothing measurable (or a negative
    # difference, noise): C = 0, so Young/Daly says every iteration and adds nothing.
    assert overhead.young_daly(1.0, 0.99, 3600.0) == (0.0, 1, 1.0)


def test_the_deepspeed_job_is_the_launchers_job_and_its_commits_are_read_from_the_console(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The DeepSpeed row's job as resihp launch reads it: its own checks accept the JSON,
    # the script's initialize() asks the uniform split (no probe, the split the stock
    # side's PipelineModule makes), and the layer count is the model's blocks + the two
    # tied ends, for every size.
    import io

    from resihp_adapters.deepspeed.launch import check_script_calls_initialize, read_resihp_section
    from resihp_adapters.deepspeed.spec import check_supported
    from resihp_core.protocols.metrics import IterationMetrics
    from resihp_core.runtime.controller.console import RunLog, console_observer

    job = overhead.ALL_JOBS["ds_pp2dp2"]
    assert job.name in overhead.JOBS and (job.pp, job.dp, job.workers, job.adapter) == (2, 2, 4, "deepspeed")
    for size, model in overhead.SIZES.items():
        monkeypatch.setattr(overhead.peers, "MODEL", dict(model))
        for every in (0, 1):
            cfg = overhead.ds_config(job, 12, every)
            sec = read_resihp_section(cfg, f"{size}.json")
            check_supported(cfg)
            assert (sec["num_layers"], sec["pp"], sec["iterations"], sec["checkpoint_every"]) == \
                (model["layers"] + 2, 2, 12, every)
            assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * \
                cfg["gradient_accumulation_steps"] * job.dp
        args = overhead.ds_script_args(model)
        assert dict(zip(args[::2], map(int, args[1::2]))) == {
            "--blocks": model["layers"], "--hidden": model["hidden"], "--heads": model["heads"],
            "--ffn": model["ffn_hidden"], "--vocab": model["vocab"]}
    assert check_script_calls_initialize(str(overhead.DS_SCRIPT)) == "uniform"
    # The controller's own console line for a commit is what the ResiHP side's commits are read from.
    out = io.StringIO()
    observe = console_observer(RunLog(tmp_path, out=out))
    for i in (0, 7, 123):
        observe(IterationMetrics(iteration=i, loss=2.5, seconds=0.4, samples=32, generation=0, phase="running"))
    got = [(int(m.group(1)), float(m.group(2))) for line in out.getvalue().splitlines()
           if (m := overhead._COMMITTED.match(line))]
    assert got == [(0, 2.5), (7, 2.5), (123, 2.5)]


def test_runs_that_log_losses_are_compared_with_the_stock_run_of_their_round() -> None:
    runs = [_run("stock", 0, 1.0) | {"losses": {3: 2.0, 4: 1.5}}, _run("resihp", 0, 1.1) | {"losses": {3: 2.0, 4: 1.5003}},
            _run("stock", 1, 1.0) | {"losses": {3: 4.0}}, _run("resihp+ckpt", 1, 1.2) | {"losses": {3: 4.002, 9: 7.0}},
            _run("resihp", 1, 9.0, ok=False) | {"losses": {3: 99.0}}]  # a failed run is left out
    f = overhead.figures(runs, mtbf_s=3600.0)
    assert f["loss_max_rel_diff_vs_stock"] == pytest.approx(0.002 / 4.0)
    assert overhead.figures(runs[:1] + [_run("resihp", 0, 1.1)], 3600.0)["loss_max_rel_diff_vs_stock"] is None
