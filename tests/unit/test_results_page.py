"""docs/results.md is generated from the benchmarks' JSON, and the docs stay written for
users: no account of how, when or by whom the project was built."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_all  # noqa: E402


def _sections(page: str) -> dict[str, str]:
    """The page's sections by file name (the text under each ``## `name` `` heading)."""
    parts = re.split(r"^## `([^`]+)`$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_page_names_each_figure_with_its_command(tmp_path: Path) -> None:
    (tmp_path / "alpha.json").write_text(json.dumps({
        "command": "python benchmarks/alpha.py --quick", "date": "2030-01-02 03:04 UTC",
        "machine": {"cpu": "Test CPU", "cores": 7}, "loadavg": [1.5, 2.5, 3.0],
        "kill_to_first_iteration_s": 0.4321, "noise_floor_pct": 0.9,
        "cases": {"hog": {"runs": 2, "misses": 0}, "stop": {"runs": 2, "misses": 1}}}))
    (tmp_path / "beta.json").write_text(json.dumps({
        "_run": {"command": "python benchmarks/beta.py --json X", "date": "2030-05-06 07:08 UTC"},
        "overhead_pct": -1.25}))
    (tmp_path / "gamma.json").write_text("{not json")
    page = run_all.generate(tmp_path, sources=[])
    sec = _sections(page)
    assert set(sec) == {"alpha.json", "beta.json", "gamma.json"}

    a = sec["alpha.json"]
    assert "`python benchmarks/alpha.py --quick`" in a and "2030-01-02 03:04 UTC" in a
    assert "Test CPU, 7 cores" in a and "load average 1.5-3.0" in a
    assert "| kill_to_first_iteration_s | 0.43 |" in a
    assert "noise_floor_pct 0.90" in a  # the noise floor named in the header
    assert re.search(r"\| stop \| 2 \| 1 \|", a)  # a dict of records is a table
    b = sec["beta.json"]
    assert "`python benchmarks/beta.py --json X`" in b and "| overhead_pct | -1.25 |" in b
    assert "kill_to_first_iteration_s" not in b  # each figure under its own command
    # What the JSON does not record is said, not invented.
    assert "- machine: not recorded" in b and "- load: not recorded" in b
    assert "unreadable JSON" in sec["gamma.json"]


def test_a_registered_benchmark_without_json_is_listed_with_its_command(tmp_path: Path) -> None:
    s = run_all.Source("x", "x.json", "x.py", ("--quick",), "X's figures", quick=True)
    page = run_all.generate(tmp_path, sources=[s])
    assert "Not measured yet" in page and "`python benchmarks/x.py --quick --json benchmarks/results/x.json`" in page
    (tmp_path / "x.json").write_text(json.dumps({"figure_a": 3}))
    sec = _sections(run_all.generate(tmp_path, sources=[s]))["x.json"]
    assert "X's figures" in sec and "not recorded (`run_all.py --run` runs `python benchmarks/x.py" in sec


def test_docs_results_md_is_what_run_all_generates() -> None:
    # The committed page and the committed JSON agree: regenerate with `python benchmarks/run_all.py`.
    assert run_all.main(["--check"]) == 0


# A narrative of the project's own development: numbered sessions, rounds or waves of work,
# fixes told as events, commits named as "before" / "after".
HISTORY = re.compile(
    r"\bsession \d+|\bsession s?\d+\b|\bs1[0-9]\b|\bround \d+ of (?:work|the work)|\bwave \d|\bstop \d+\b"
    r"|\bwas fixed\b|\bfixed in\b|\bafter the fix\b|\bbefore the fix\b|\bthis branch\b|\bhelpers?'? (?:tests|ran)"
    r"|\bin this session\b|\bthe (?:first|second|third|fourth) run\b"
    r"|\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b",  # the day or hour something was measured
    re.I)


def test_docs_tell_no_development_history() -> None:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name == "results.md":  # generated: dates and machines belong there
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = HISTORY.search(line)
            if m:
                found.append(f"{path.name}:{n}: {m.group(0)!r}: {line.strip()[:100]}")
    assert not found, "docs narrate development history:\n" + "\n".join(found)


def test_the_history_pattern_catches_narrative_and_spares_ordinary_prose() -> None:
    for narrative in ("Latest, session 11: the hog", "the JSON of stop 7", "was fixed in round 3 of work",
                      "measured 2026-12-04 13:14 UTC", "after the fix: 5 of 5", "in wave 2 the loop"):
        assert HISTORY.search(narrative), narrative
    for prose in ("SIGSTOP 15 s, then SIGCONT", "the job session holds the generation", "a stop every hour",
                  "checkpoint_every - 1 iterations", "torch 2.11, CUDA 13.0"):
        assert not HISTORY.search(prose), prose
