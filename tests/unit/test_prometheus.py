"""The Prometheus exporter plugin: exposition format, hook counting, text file, HTTP."""

from __future__ import annotations

import logging
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import pytest

from resihp_core.plan import ParallelPlan
from resihp_core.plugins import Plugins
from resihp_core.protocol import FailureReport
from resihp_core.protocol.messages import Cause
from resihp_plugins import prometheus
from resihp_plugins.prometheus import CONTENT_TYPE, PrometheusExporter, escape_label, format_value

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
COMMENT_RE = re.compile(rf"^# (HELP|TYPE) ({NAME}) (.*)$")
SAMPLE_RE = re.compile(rf"^({NAME})(\{{(?:{LABEL})(?:,{LABEL})*\}})? (\S+)$")
VALUE_RE = re.compile(r"^(NaN|[+-]Inf|-?\d+(\.\d+)?([eE][+-]?\d+)?)$")


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, str], float]]:
    """Check the text exposition format line by line; return (types, samples) with
    samples keyed (name, label text)."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = COMMENT_RE.match(line)
        if m:
            kind, name, rest = m.groups()
            if kind == "TYPE":
                assert name not in types, f"TYPE twice for {name}"
                assert rest in ("counter", "gauge", "histogram", "summary", "untyped"), line
                types[name] = rest
            else:
                assert name not in helps and rest, line
                helps.add(name)
            continue
        m = SAMPLE_RE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.groups()
        assert name in types, f"sample before its TYPE: {line!r}"
        assert VALUE_RE.match(value), line
        key = (name, labels or "")
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value)
    assert helps == set(types)
    return types, samples


def plan(generation: int) -> ParallelPlan:
    return ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=2, num_microbatches=2).with_(
        generation=generation
    )


def slow(cause: str = "compute") -> FailureReport:
    return FailureReport(generation=0, failure="fail-slow", devices=(3,), cause=cause,
                         throughput={3: 0.5})


@pytest.fixture
def facade() -> Plugins:
    return Plugins(builtins=[], autoload=False)


# ----------------------------------------------------------------- format
def test_render_fresh_exporter() -> None:
    types, samples = parse(PrometheusExporter().render())
    assert types == {
        "resihp_failures_total": "counter",
        "resihp_plan_changes_total": "counter",
        "resihp_plan_generation": "gauge",
        "resihp_iterations_total": "counter",
        "resihp_iteration": "gauge",
        "resihp_iteration_seconds": "gauge",
        "resihp_throughput_samples_per_second": "gauge",
        "resihp_loss": "gauge",
    }
    for name, kind in types.items():  # counters end in _total, gauges do not
        assert name.endswith("_total") == (kind == "counter")
    failures = {k: v for k, v in samples.items() if k[0] == "resihp_failures_total"}
    # one series per (failure class, cause), declared before the first report
    assert len(failures) == 2 * len(get_args(Cause)) and set(failures.values()) == {0.0}
    assert ("resihp_failures_total", '{failure="fail-slow",cause="contention"}') in failures
    assert ("resihp_failures_total", '{failure="fail-stop",cause="communication"}') in failures
    assert samples[("resihp_iterations_total", "")] == 0
    assert ("resihp_plan_generation", "") not in samples  # unknown gauges have no sample


def test_value_and_label_formatting() -> None:
    assert format_value(3) == "3" and format_value(2.0) == "2" and format_value(0.25) == "0.25"
    assert format_value(float("nan")) == "NaN"
    assert format_value(float("inf")) == "+Inf" and format_value(float("-inf")) == "-Inf"
    assert format_value(1e-9) == "1e-09"
    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


# ----------------------------------------------------------------- hooks
def test_counters_through_the_facade(facade: Plugins) -> None:
    exp = PrometheusExporter()
    assert facade.register(exp, name="prometheus") == "prometheus"
    assert "prometheus" in facade.names()

    facade.notify_failure(slow())
    facade.notify_failure(slow())
    facade.notify_failure(FailureReport(generation=1, failure="fail-stop", devices=(5,)))
    facade.notify_plan_changed(None, plan(0), "initial")
    facade.notify_plan_changed(plan(0), plan(2), "fail-stop device 5")
    for i in range(3):
        facade.notify_iteration({"iteration": 10 + i, "seconds": 0.5, "samples": 16,
                                 "loss": 2.0 - i / 4, "generation": 2})

    _, s = parse(exp.render())
    assert s[("resihp_failures_total", '{failure="fail-slow",cause="compute"}')] == 2
    assert s[("resihp_failures_total", '{failure="fail-stop",cause="unknown"}')] == 1
    assert s[("resihp_failures_total", '{failure="fail-slow",cause="communication"}')] == 0
    assert s[("resihp_plan_changes_total", "")] == 2
    assert s[("resihp_plan_generation", "")] == 2
    assert s[("resihp_iterations_total", "")] == 3
    assert s[("resihp_iteration", "")] == 12
    assert s[("resihp_iteration_seconds", "")] == 0.5
    assert s[("resihp_throughput_samples_per_second", "")] == 32
    assert s[("resihp_loss", "")] == 1.5
    assert exp.value("resihp_failures_total", failure="fail-slow", cause="compute") == 2
    assert exp.value("resihp_iterations_total") == 3

    facade.unregister("prometheus")
    facade.notify_failure(slow())
    assert exp.value("resihp_failures_total", failure="fail-slow", cause="compute") == 2


def test_metrics_as_an_object_and_direct_throughput(facade: Plugins) -> None:
    @dataclass
    class IterationMetrics:
        iteration: int
        seconds: float
        samples_per_second: float
        generation: int = 0

    exp = PrometheusExporter()
    facade.register(exp)
    facade.notify_iteration(IterationMetrics(iteration=7, seconds=2.0, samples_per_second=12.5))
    assert exp.value("resihp_throughput_samples_per_second") == 12.5
    assert exp.value("resihp_iteration_seconds") == 2.0
    assert exp.value("resihp_loss") is None  # not given: the gauge stays unset
    with pytest.raises(KeyError):
        exp.value("resihp_nope")


def test_bad_metrics_are_logged_and_still_counted(facade: Plugins, caplog: pytest.LogCaptureFixture) -> None:
    exp = PrometheusExporter()
    facade.register(exp, name="prom")
    with caplog.at_level(logging.ERROR, logger="resihp.plugins"):
        facade.notify_iteration({"iteration": 1, "seconds": "fast"})
    assert "prom" in caplog.text and "'seconds' must be a number" in caplog.text
    assert exp.value("resihp_iterations_total") == 1
    assert exp.value("resihp_iteration") is None  # nothing half-applied


def test_module_is_a_plugin(facade: Plugins) -> None:
    name = facade.register(prometheus)
    assert name == "resihp_plugins.prometheus"
    before = prometheus.EXPORTER.value("resihp_failures_total", failure="fail-slow", cause="communication")
    facade.notify_failure(slow("communication"))
    after = prometheus.EXPORTER.value("resihp_failures_total", failure="fail-slow", cause="communication")
    assert after == before + 1


# ----------------------------------------------------------------- exporting
def test_textfile_rewritten_on_every_update(tmp_path: Path, facade: Plugins) -> None:
    path = tmp_path / "collector" / "resihp.prom"
    exp = PrometheusExporter(textfile=path)
    facade.register(exp)
    facade.notify_plan_changed(None, plan(1), "initial")
    _, s = parse(path.read_text())
    assert s[("resihp_plan_generation", "")] == 1
    facade.notify_iteration({"iteration": 0, "seconds": 1.0, "samples": 4})
    assert path.read_text() == exp.render()
    assert [p.name for p in path.parent.iterdir()] == ["resihp.prom"]  # no temporary left


def test_http_serve_and_shutdown() -> None:
    exp = PrometheusExporter()
    port = exp.serve(0)
    try:
        assert port > 0 and exp.port == port
        with pytest.raises(RuntimeError, match="already serving"):
            exp.serve(0)
        exp.resihp_failure_reported(slow())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == CONTENT_TYPE
            body = r.read().decode()
        _, s = parse(body)
        assert s[("resihp_failures_total", '{failure="fail-slow",cause="compute"}')] == 1
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5)
        assert err.value.code == 404
        err.value.close()
    finally:
        exp.shutdown()
    assert exp.port is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    exp.shutdown()  # idempotent
