"""The report writer: files, hand-checked statistics, input errors."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from resihp_core.report import (
    ReportError,
    _check_events,
    _event_x,
    format_table,
    summary_table,
    t_quantile_975,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def row(i: int, seconds: float, samples: int, phase: str, gen: int = 0, loss: float = 1.0) -> dict:
    return {"iteration": i, "loss": loss, "seconds": seconds, "samples": samples,
            "generation": gen, "phase": phase}


# Phase A: throughputs 4, 2; phase B: 4, 4, 2; phase C: one iteration.
TINY = [
    row(0, 1.0, 4, "A"),
    row(1, 2.0, 4, "A"),
    row(2, 0.5, 2, "B", gen=1),
    row(3, 0.5, 2, "B", gen=1),
    row(4, 1.0, 2, "B", gen=2),
    row(5, 4.0, 8, "C", gen=2),
]


# ----------------------------------------------------------------- statistics
def test_summary_table_by_hand() -> None:
    a, b, c = summary_table(TINY)
    assert [r["phase"] for r in (a, b, c)] == ["A", "B", "C"]

    # A: samples/s = [4, 2]; mean 3; s = sqrt(((4-3)^2 + (2-3)^2) / 1) = sqrt(2);
    # half-width = t(0.975, 1) * sqrt(2) / sqrt(2) = 12.7062.
    assert a["iterations"] == 2 and a["generations"] == [0] and a["samples"] == 8
    assert a["mean_seconds"] == pytest.approx(1.5)
    assert a["throughput"] == pytest.approx(3.0)
    assert a["throughput_std"] == pytest.approx(math.sqrt(2))
    assert a["throughput_ci"] == pytest.approx(12.7062)
    assert a["relative"] == pytest.approx(1.0)

    # B: samples/s = [4, 4, 2]; mean 10/3; s^2 = (4/9 + 4/9 + 16/9) / 2 = 4/3;
    # half-width = t(0.975, 2) * sqrt(4/3) / sqrt(3) = 4.3027 * 2/3 = 2.868467.
    assert b["iterations"] == 3 and b["generations"] == [1, 2]
    assert (b["first_iteration"], b["last_iteration"]) == (2, 4)
    assert b["mean_seconds"] == pytest.approx(2 / 3)
    assert b["total_seconds"] == pytest.approx(2.0)
    assert b["throughput"] == pytest.approx(10 / 3)
    assert b["throughput_ci"] == pytest.approx(2.868467, abs=1e-6)
    assert b["t_quantile"] == pytest.approx(4.3027)
    assert b["relative"] == pytest.approx((10 / 3) / 3)

    # C: one iteration, no interval.
    assert c["throughput"] == pytest.approx(2.0)
    assert c["throughput_ci"] is None and c["t_quantile"] is None and c["std_seconds"] == 0.0


def _t_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer df (Abramowitz & Stegun 26.7.3/26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        total, term = 0.0, c
        if df > 1:
            total = term
            for k in range(3, df - 1, 2):  # 2/3 cos^3, (2*4)/(3*5) cos^5, ...
                term *= (k - 1) / k * c * c
                total += term
        return 2 / math.pi * (theta + s * total)
    total, term = 1.0, 1.0
    for k in range(2, df - 1, 2):  # 1/2 cos^2, (1*3)/(2*4) cos^4, ...
        term *= (k - 1) / k * c * c
        total += term
    return s * total


@pytest.mark.parametrize("df", [1, 2, 3, 5, 10, 17, 29, 30, 31, 40, 60, 120, 1000])
def test_t_quantile_matches_the_t_distribution(df: int) -> None:
    assert _t_two_sided(t_quantile_975(df), df) == pytest.approx(0.95, abs=2e-5)


def test_t_quantile_is_decreasing_towards_normal() -> None:
    qs = [t_quantile_975(df) for df in range(1, 200)]
    assert all(x > y for x, y in zip(qs, qs[1:]))
    assert qs[-1] > 1.959963984540054
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_format_table() -> None:
    text = format_table(summary_table(TINY))
    lines = text.splitlines()
    assert len(lines) == 2 + 3
    assert lines[0].split()[0] == "phase" and set(lines[1]) <= {"-", " "}
    assert "3.000 ± 12.706" in lines[2]
    assert "3.333 ± 2.868" in lines[3] and "1.11x" in lines[3]
    assert "(n=1)" in lines[4]


def test_event_positions_from_time_and_iteration() -> None:
    rows = [row(10, 1.0, 1, "A"), row(11, 1.0, 1, "A"), row(12, 2.0, 1, "A")]
    events = [{"kind": "x", "text": "", "time": 3.0},   # halfway through iteration 12 (2..4 s)
              {"kind": "x", "text": "", "time": 1.0},   # end of iteration 10
              {"kind": "x", "text": "", "iteration": 11},
              {"kind": "x", "text": "", "time": 99.0}]  # after the end
    assert _event_x(_check_events(events), rows) == pytest.approx([12.0, 10.5, 11.0, 12.5])
    # With end times recorded the mapping uses them (job started 5 s before iteration 10).
    timed = [dict(r, time=t) for r, t in zip(rows, (6.0, 7.0, 9.0))]
    assert _event_x(_check_events([{"kind": "x", "text": "", "time": 8.0}]), timed) == pytest.approx([12.0])


# ----------------------------------------------------------------- the files
@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    its = []
    for i in range(24):
        phase = "healthy" if i < 8 else "fail-slow (unmitigated)" if i < 14 else "fail-slow (ResiHP)"
        its.append(row(i, (1.0 if i < 8 else 2.0 if i < 14 else 1.2) + 0.01 * (i % 3), 16, phase,
                       gen=0 if i < 14 else 1, loss=4.0 * 0.95**i))
    events = [
        {"iteration": 8, "kind": "injection", "generation": 0, "text": "slow compute x2 on device 3"},
        {"time": 21.5, "kind": "failure", "generation": 0, "text": "fail-slow device 3", "devices": [3]},
        {"iteration": 14, "kind": "plan", "generation": 1, "text": "generation 1: TP resize"},
        {"iteration": 20, "kind": "note", "text": "checkpoint | saved"},
    ]
    out = tmp_path_factory.mktemp("report") / "nested"
    paths = write_report(out, iterations=its, events=events,
                         reference_losses=[4.0 * 0.95**i for i in range(24)], title="tiny run")
    return paths


def test_report_files(report: dict[str, Path]) -> None:
    assert set(report) == {"events", "loss", "iteration_time", "throughput", "summary"}
    for key in ("loss", "iteration_time", "throughput"):
        data = report[key].read_bytes()
        assert data[:8] == PNG_SIGNATURE, key
        assert len(data) > 5_000, (key, len(data))
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 600 and height >= 400, (key, width, height)


def test_report_json_and_markdown(report: dict[str, Path]) -> None:
    record = json.loads(report["events"].read_text())
    assert record["title"] == "tiny run"
    assert len(record["iterations"]) == 24 and len(record["events"]) == 4
    assert record["events"][1]["devices"] == [3]
    assert [p["phase"] for p in record["phases"]] == [
        "healthy", "fail-slow (unmitigated)", "fail-slow (ResiHP)"]

    md = report["summary"].read_text()
    assert md.startswith("# tiny run")
    assert "| phase | iterations |" in md
    assert "| fail-slow (ResiHP) | 10 | 1 |" in md
    assert "**injection** gen 0: slow compute x2 on device 3" in md
    assert "t=21.50s **failure**" in md
    assert "checkpoint | saved" in md  # event text is free text in a list, not a table cell
    assert "max |Δ| = 0" in md


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("iterations", "match"),
    [
        ([], "iterations is empty"),
        ("abc", "must be a list"),
        ([row(0, 1, 1, "A"), 5], r"iterations\[1\]: expected a dict"),
        ([row(0, 1, 1, "A"), row(1, 1, 1, "A"),
          {k: v for k, v in row(2, 1, 1, "A").items() if k != "seconds"}],
         r"iterations\[2\]: missing key 'seconds'"),
        ([row(0, 0.0, 1, "A")], r"iterations\[0\]: key 'seconds' must be a finite number > 0"),
        ([row(0, 1, 1, "A"), row(1, 1, -1, "A")], r"iterations\[1\]: key 'samples'"),
        ([dict(row(0, 1, 1, "A"), loss="high")], r"iterations\[0\]: key 'loss'"),
        ([dict(row(0, 1, 1, "A"), generation=True)], r"iterations\[0\]: key 'generation'"),
        ([row(0, 1, 1, "")], r"iterations\[0\]: key 'phase'"),
        ([row(3, 1, 1, "A"), row(3, 1, 1, "A")], r"iterations\[1\]: key 'iteration' must increase"),
    ],
)
def test_malformed_iterations(iterations: object, match: str) -> None:
    with pytest.raises(ReportError, match=match):
        summary_table(iterations)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"events": [{"kind": "plan", "text": "x"}]}, r"events\[0\]: needs key 'iteration' or key 'time'"),
        ({"events": [{"iteration": 1, "kind": "plan", "text": "x"}, {"iteration": 1, "text": "y"}]},
         r"events\[1\]: missing key 'kind'"),
        ({"events": [{"time": -1.0, "kind": "plan", "text": "x"}]}, r"events\[0\]: key 'time'"),
        ({"events": [], "reference_losses": [1.0, None]}, r"reference_losses\[1\]"),
    ],
)
def test_malformed_events_and_reference(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ReportError, match=match):
        write_report(tmp_path / "r", iterations=[row(0, 1.0, 1, "A"), row(1, 1.0, 1, "A")], **kwargs)
    assert not (tmp_path / "r").exists()  # validated before anything is written


def test_report_error_is_a_value_error() -> None:
    assert issubclass(ReportError, ValueError)


def test_event_labels_and_phase_names_do_not_overlap() -> None:
    """Events one iteration apart (injection, detection, plan change) get labels side by
    side, clear of the data; long phase names wrap instead of running into each other."""
    from resihp_core.report import _check_events, _figure, _mark_events, _wrap

    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(range(40), [1.0] * 40)
    ax.set_ylim(0, 1.7)
    evs = [{"kind": k, "text": f"{k} event with a long description {j}", "iteration": it}
           for j, (k, it) in enumerate([("injection", 20), ("failure", 20), ("plan", 21), ("plan", 30)])]
    _mark_events(ax, _check_events(evs), [float(e["iteration"]) for e in evs], annotate=True)
    fig.tight_layout()
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the text, not its leader line
    assert len(boxes) == 4
    for a in range(4):
        for b in range(a + 1, 4):
            assert not boxes[a].overlaps(boxes[b]), (a, b)
    assert all(line == line[:18] for line in _wrap("2 after slow x2.22 on device 3, adapted", 18).splitlines())
