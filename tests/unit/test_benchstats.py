"""The benchmarks' statistics: order-statistic intervals, paired normalised ratios, floors."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import benchstats as bs  # noqa: E402


def test_median_ci_coverage_is_the_binomial_one() -> None:
    # 3 values: no k reaches 95 %, the min-max range covers 1 - 2/8 = 75 %.
    ci = bs.median_ci([3.0, 1.0, 2.0])
    assert (ci.median, ci.lo, ci.hi, ci.n) == (2.0, 1.0, 3.0, 3)
    assert ci.confidence == pytest.approx(0.75)
    # 6 values: [x_(1), x_(6)] covers 1 - 2/64 = 96.9 %; [x_(2), x_(5)] only 78 %.
    ci = bs.median_ci([6, 5, 4, 3, 2, 1])
    assert (ci.lo, ci.hi) == (1, 6) and ci.confidence == pytest.approx(1 - 2 / 64)
    # 20 values: k = 6 gives 95.9 % (k = 7: 88.5 %).
    ci = bs.median_ci(list(range(20)))
    assert (ci.lo, ci.hi) == (5, 14) and ci.confidence == pytest.approx(0.9586, abs=1e-4)
    assert bs.median_ci([]).n == 0 and math.isnan(bs.median_ci([]).median)
    assert bs.median_ci([4.0]).confidence == 0.0


def test_median_ci_covers_the_true_median_as_often_as_it_claims() -> None:
    rng = random.Random(1)
    hits = 0
    trials = 2000
    for _ in range(trials):
        ci = bs.median_ci([rng.expovariate(1.0) for _ in range(11)])
        hits += ci.lo <= math.log(2) <= ci.hi
    claimed = bs.median_ci(list(range(11))).confidence
    assert claimed >= 0.95
    assert abs(hits / trials - claimed) < 0.02


def test_retained_ratio_cancels_a_run_speed_difference() -> None:
    # Run A is 30 % faster before the fault (another tenant slowed run B throughout):
    # both keep the same fraction, so the normalised ratio is 1 while the raw one is 1.3.
    p = bs.Pair(a_healthy=13.0, a_faulty=6.5, b_healthy=10.0, b_faulty=5.0)
    assert p.ratio == pytest.approx(1.0)
    assert p.control == pytest.approx(1.3)
    r = bs.paired_ratio([p], floor=0.5)
    assert r.raw_ratio is not None and r.raw_ratio.median == pytest.approx(1.3)
    with pytest.raises(ValueError, match="healthy"):
        bs.retained(1.0, 0.0)


def test_pairs_whose_control_is_off_by_more_than_the_noise_are_flagged_not_averaged() -> None:
    good = [bs.Pair(10.0, 8.0, 10.0 * c, 5.0 * c, 0.01, 0.01) for c in (1.0, 0.99, 1.01)]
    bad = bs.Pair(10.0, 9.9, 7.0, 3.0, 0.01, 0.01)  # control 1.43, noise 1.4 %
    r = bs.paired_ratio([good[0], bad, *good[1:]])
    assert r.flagged == [1]
    assert r.ratio.n == 3 and r.ratio.median == pytest.approx(1.6)
    assert r.control.n == 4  # the control is reported over every pair
    # A noisy healthy phase widens the tolerance: the same control then passes.
    noisy = bs.Pair(10.0, 9.9, 7.0, 3.0, 0.12, 0.12)
    assert bs.paired_ratio([noisy]).flagged == []


def test_rel_se_and_floor_correction() -> None:
    assert bs.rel_se([1.0]) == 0.0
    assert bs.rel_se([9.0, 11.0]) == pytest.approx(math.sqrt(2) / math.sqrt(2) / 10)
    assert bs.floor_corrected(5.0, 3.0) == pytest.approx(4.0)
    assert bs.floor_corrected(1.0, 3.0) == 0.0


def test_machine_and_load_are_recorded() -> None:
    m = bs.machine()
    assert m["cores"] and "python" in m
    load = bs.loadavg()
    assert load is None or len(load) == 3


def test_run_all_table_leaves_flagged_pairs_out_and_states_the_load() -> None:
    import run_all

    e2e_json = {
        "one_core_pp": {"pairs": [{}, {}, {}],
                        "window": {"ratios": [1.5, 9.0, 1.4], "controls": [1.0, 1.4, 0.99], "flagged": [1]},
                        "steady": {"ratios": [1.6, 1.5], "flagged": []}},
        "failstop": {"pairs": [{}, {}], "ratios": [0.95, 0.97], "flagged_pairs": []},
        "failed": {}, "config": {},
    }
    vals = run_all.e2e(e2e_json)
    assert vals["one_core_pp: retained ratio, window"] == [1.5, 1.4]  # the flagged 9.0 left out
    assert vals["one_core_pp: healthy-phase control"] == [1.0, 1.4, 0.99]  # controls all shown
    assert vals["one_core_pp: flagged pairs"] == [1.0]
    assert vals["fail-stop recovered / best fresh static"] == [0.95, 0.97]
    bench = next(b for b in run_all.BENCHES if b.name == "e2e")
    recs = [{"benchmark": "e2e", "rc": 0, "values": vals, "loadavg_before": [1.2, 1, 1],
             "loadavg_after": [0.8, 1, 1]}]
    rows = run_all.table(recs, [bench])
    row = next(r for r in rows if r["figure"] == "one_core_pp: retained ratio, window")
    assert (row["median"], row["min"], row["max"], row["n"], row["target"]) == (1.45, 1.4, 1.5, 2, ">= 1.3x")
    assert row["load_1min"] == [0.8, 1.2]
    md = run_all.markdown(rows, {"date": "2026-11-30 23:00 UTC", "machine": {"cpu": "X", "cores": 2},
                                 "quick": True, "reps": 2, "seconds": 60, "load_min": 0.8, "load_max": 1.2,
                                 "failed": {}})
    assert "| `e2e.py` | one_core_pp: retained ratio, window | 1.45 | 1.40 .. 1.50 | 2 | 0.8-1.2 | >= 1.3x |" in md
    assert "load average (1 min) 0.8-1.2" in md and "--quick --reps 2" in md


def test_predictor_and_reconfigure_extractors_read_the_floor() -> None:
    import run_all

    v = run_all.predictor({"mape_total_pct": 1.8, "mape_floor_pct": 0.4, "mape_total_beyond_floor_pct": 1.75})
    assert v == {"mape_total_pct": [1.8], "mape_floor_pct": [0.4], "mape_total_beyond_floor_pct": [1.75]}
    r = run_all.reconfigure({"kill_kill_to_first_iteration_s": 0.5, "iteration_mape_pct": 3.0,
                             "mape_floor_pct": 1.0, "migration": [{"bytes_moved": 2e6, "state_s": 0.01}]})
    assert r["kill -> first iteration_s"] == [0.5] and r["layer migration MB/s (median of moves)"] == [200.0]


def test_rerun_comparison_checks_each_median_against_the_previous_range() -> None:
    import run_all

    def row(fig, med, lo, hi, n=3, target="<= 2"):
        return {"benchmark": "a.py", "figure": fig, "median": med, "min": lo, "max": hi, "n": n, "target": target}

    old = [row("x", 1.5, 1.0, 2.0), row("y", 1.5, 1.0, 2.0), row("w", 1.5, 1.0, 2.0),
           row("flagged pairs", 0.0, 0.0, 0.0)]
    new = [row("x", 1.5, 1.2, 1.8), row("y", 2.5, 2.1, 2.9), row("w", 2.1, 1.9, 2.4), row("z", 9.0, 9.0, 9.0),
           row("flagged pairs", 1.0, 1.0, 1.0)]
    cmp = {c["figure"]: c for c in run_all.compare(new, old)}
    assert sorted(cmp) == ["w", "x", "y"]  # z is new; diagnostic counts are not compared
    assert (cmp["x"]["inside"], cmp["y"]["inside"], cmp["w"]["inside"]) == (True, False, False)
    assert (cmp["y"]["overlap"], cmp["w"]["overlap"]) == (False, True)
    assert cmp["x"]["verdict_same"] and not cmp["w"]["verdict_same"]  # 1.5 met <= 2; 2.1 did not
    md = run_all.compare_markdown(list(cmp.values()), run_all.Path("old.json"))
    assert "1 of 3 medians inside" in md and "2 of 3 ranges overlap" in md


def test_chance_that_a_reproducible_median_lands_inside_a_small_range() -> None:
    import run_all

    # The median of 3 draws lies inside the min-max of 3 others with probability 0.6
    # (exactly 3/5 for continuous draws); with more repetitions it approaches 1.
    assert abs(run_all.chance_inside(3, 3) - 0.6) < 0.02
    assert run_all.chance_inside(3, 3) < run_all.chance_inside(5, 5) < run_all.chance_inside(7, 7) < 1
    assert run_all.chance_inside(1, 3) == 0.0


def test_target_verdicts_are_read_from_the_target_text() -> None:
    import run_all

    assert run_all._meets("<= 2 %", 2.0) and not run_all._meets("< 1 % (to judge 2 %)", 1.0)
    assert run_all._meets(">= 1.3x", 1.31) and run_all._meets("all", 5) is None
