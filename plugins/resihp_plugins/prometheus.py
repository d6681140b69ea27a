"""Prometheus metrics for a ResiHP job: an observer plugin.

:class:`PrometheusExporter` implements the three observer hooks and keeps these metrics,
rendered in the Prometheus text exposition format (version 0.0.4) by
:meth:`PrometheusExporter.render`:

==========================================  =======  ===========================================
``resihp_failures_total{failure,cause}``    counter  confirmed failures (``failure``: fail-stop /
                                                     fail-slow; ``cause``: compute /
                                                     communication / contention / unknown); every known
                                                     combination starts at 0
``resihp_plan_changes_total``               counter  plan generations deployed
``resihp_plan_generation``                  gauge    the running plan's generation
``resihp_iterations_total``                 counter  training iterations finished
``resihp_iteration``                        gauge    number of the last finished iteration
``resihp_iteration_seconds``                gauge    wall time of the last iteration
``resihp_throughput_samples_per_second``    gauge    samples/s of the last iteration
``resihp_loss``                             gauge    loss of the last iteration
==========================================  =======  ===========================================

A gauge with no value yet is listed (``# HELP``/``# TYPE``) without a sample.

**Iteration metrics.** ``resihp_iteration_finished(metrics)`` accepts a mapping or an
object with attributes (such as a dataclass) with these keys, each optional:

* ``iteration`` (int): the iteration number;
* ``seconds`` (float > 0): its wall time;
* ``samples`` (int): sequences or micro-batches it processed; with ``seconds`` gives
  the throughput;
* ``samples_per_second`` (float): the throughput, when given directly (wins over
  ``samples / seconds``);
* ``loss`` (float);
* ``generation`` (int): the plan generation it ran under (sets the gauge too).

A value of the wrong type raises :class:`ValueError` naming the key (the plugin facade
logs it and the other observers still run); the counter of iterations still counts it.

**Use.** Register an instance with the facade, then export::

    from resihp_core.plugins import get_plugins
    from resihp_plugins.prometheus import PrometheusExporter

    exporter = PrometheusExporter(textfile="/var/lib/node_exporter/resihp.prom")
    get_plugins().register(exporter, name="prometheus")
    port = exporter.serve(9400)          # GET http://127.0.0.1:9400/metrics

The module itself is also a plugin (its functions forward to :data:`EXPORTER`), so an
entry point ``prometheus = "resihp_plugins.prometheus"`` in group ``resihp`` enables it;
then call ``resihp_plugins.prometheus.EXPORTER.serve(...)``. Register either the module
or an instance of your own, not both, or every event is counted twice.

The HTTP server is the standard library's, in a daemon thread, bound to loopback by
default; it serves ``/metrics`` (and ``/``) and answers 404 elsewhere. The text file is
rewritten atomically (temporary file + rename) after every update, the way node
exporter's textfile collector expects.
"""

from __future__ import annotations

import math
import numbers
import os
import tempfile
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from resihp_core.hookspecs import hookimpl
from resihp_core.protocol import Cause, FailureClass

if TYPE_CHECKING:
    from resihp_core.plan import ParallelPlan
    from resihp_core.protocol import FailureReport

__all__ = ["CONTENT_TYPE", "EXPORTER", "PrometheusExporter", "format_value", "escape_label"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_FAILURES = tuple(get_args(FailureClass))
_CAUSES = tuple(get_args(Cause))

# name -> (type, help); the order of rendering.
_FAMILIES: dict[str, tuple[str, str]] = {
    "resihp_failures_total": ("counter", "Confirmed failures by class and cause."),
    "resihp_plan_changes_total": ("counter", "Plan generations deployed."),
    "resihp_plan_generation": ("gauge", "Generation of the running parallel plan."),
    "resihp_iterations_total": ("counter", "Training iterations finished."),
    "resihp_iteration": ("gauge", "Number of the last finished iteration."),
    "resihp_iteration_seconds": ("gauge", "Wall time of the last finished iteration in seconds."),
    "resihp_throughput_samples_per_second": ("gauge", "Samples per second in the last finished iteration."),
    "resihp_loss": ("gauge", "Training loss of the last finished iteration."),
}


def format_value(v: float) -> str:
    """A sample value as Prometheus writes it (``NaN``, ``+Inf``, ``-Inf``, ints bare)."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, numbers.Integral):
        return str(int(v))
    f = float(v)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    return repr(f)


def escape_label(value: str) -> str:
    """Escape a label value: backslash, double quote and newline."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _get(metrics: Any, key: str) -> Any:
    if isinstance(metrics, Mapping):
        return metrics.get(key)
    return getattr(metrics, key, None)


def _real(metrics: Any, key: str) -> float | None:
    v = _get(metrics, key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"iteration metrics: key {key!r} must be a number, got {v!r}")
    return float(v)


def _int(metrics: Any, key: str) -> int | None:
    v = _get(metrics, key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"iteration metrics: key {key!r} must be an int, got {v!r}")
    return int(v)


class PrometheusExporter:
    """Observer plugin keeping ResiHP's Prometheus metrics (see the module doc).

    :param textfile: when given, the exposition is written to this path after every
        update (atomically), for node exporter's textfile collector.
    """

    def __init__(self, *, textfile: str | Path | None = None) -> None:
        self.textfile: Path | None = Path(textfile) if textfile is not None else None
        self._lock = threading.Lock()
        self._failures: dict[tuple[str, str], int] = {(f, c): 0 for f in _FAILURES for c in _CAUSES}
        self._counters: dict[str, int] = {"resihp_plan_changes_total": 0, "resihp_iterations_total": 0}
        self._gauges: dict[str, float | int] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- hooks
    @hookimpl
    def resihp_failure_reported(self, report: FailureReport) -> None:
        key = (str(report.failure), str(getattr(report, "cause", "unknown")))
        with self._lock:
            self._failures[key] = self._failures.get(key, 0) + 1
        self._updated()

    @hookimpl
    def resihp_plan_changed(self, old: ParallelPlan | None, new: ParallelPlan, reason: str) -> None:
        with self._lock:
            self._counters["resihp_plan_changes_total"] += 1
            self._gauges["resihp_plan_generation"] = int(new.generation)
        self._updated()

    @hookimpl
    def resihp_iteration_finished(self, metrics: Any) -> None:
        try:
            values: dict[str, float | int] = {}
            it = _int(metrics, "iteration")
            if it is not None:
                values["resihp_iteration"] = it
            gen = _int(metrics, "generation")
            if gen is not None:
                values["resihp_plan_generation"] = gen
            seconds = _real(metrics, "seconds")
            if seconds is not None:
                if not seconds > 0:
                    raise ValueError(f"iteration metrics: key 'seconds' must be > 0, got {seconds!r}")
                values["resihp_iteration_seconds"] = seconds
            samples = _int(metrics, "samples")
            rate = _real(metrics, "samples_per_second")
            if rate is None and samples is not None and seconds is not None:
                rate = samples / seconds
            if rate is not None:
                values["resihp_throughput_samples_per_second"] = rate
            loss = _real(metrics, "loss")
            if loss is not None:
                values["resihp_loss"] = loss
        finally:
            with self._lock:
                self._counters["resihp_iterations_total"] += 1
        with self._lock:
            self._gauges.update(values)
        self._updated()

    # ------------------------------------------------------------- reading
    def value(self, name: str, **labels: str) -> float | int | None:
        """The current value of one sample (None for a gauge not set yet); for tests and
        dashboards in the same process."""
        with self._lock:
            if name == "resihp_failures_total":
                return self._failures.get((labels.get("failure", ""), labels.get("cause", "")), 0)
            if name in self._counters:
                return self._counters[name]
            if name in _FAMILIES:
                return self._gauges.get(name)
        raise KeyError(f"unknown metric {name!r} (known: {', '.join(_FAMILIES)})")

    def render(self) -> str:
        """The metrics in the Prometheus text exposition format, ending in a newline."""
        with self._lock:
            failures = dict(self._failures)
            counters = dict(self._counters)
            gauges = dict(self._gauges)
        lines: list[str] = []
        for name, (kind, text) in _FAMILIES.items():
            lines.append(f"# HELP {name} {_escape_help(text)}")
            lines.append(f"# TYPE {name} {kind}")
            if name == "resihp_failures_total":
                for (f, c), n in sorted(failures.items()):
                    lines.append(
                        f'{name}{{failure="{escape_label(f)}",cause="{escape_label(c)}"}} {n}'
                    )
            elif name in counters:
                lines.append(f"{name} {format_value(counters[name])}")
            elif name in gauges:
                lines.append(f"{name} {format_value(gauges[name])}")
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------- exporting
    def _updated(self) -> None:
        if self.textfile is not None:
            self.write_textfile(self.textfile)

    def write_textfile(self, path: str | Path) -> Path:
        """Write :meth:`render` to ``path`` atomically (temporary file in the same folder,
        then rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.render())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve the metrics over HTTP at ``http://host:port/metrics`` from a daemon
        thread; ``port=0`` picks a free port. Returns the bound port.

        :raises RuntimeError: already serving (call :meth:`shutdown` first).
        :raises OSError: the address cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError(f"already serving on port {self.port}; call shutdown() first")
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, head_only: bool) -> None:
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "try /metrics")
                    return
                body = exporter.render().encode("utf-8")
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head_only:
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._send(head_only=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._send(head_only=True)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # scrapes every few seconds would flood stderr

        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2},
            name=f"resihp-prometheus:{server.server_address[1]}", daemon=True,
        )
        self._thread.start()
        return self.port  # type: ignore[return-value]

    @property
    def port(self) -> int | None:
        """The port being served, or None."""
        return None if self._server is None else int(self._server.server_address[1])

    def shutdown(self) -> None:
        """Stop the HTTP server (if any) and wait for its thread."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)


#: The instance behind the module-level hook implementations.
EXPORTER = PrometheusExporter()


@hookimpl
def resihp_failure_reported(report: FailureReport) -> None:
    """Forwards to :data:`EXPORTER` (the module registered as a plugin)."""
    EXPORTER.resihp_failure_reported(report)


@hookimpl
def resihp_plan_changed(old: ParallelPlan | None, new: ParallelPlan, reason: str) -> None:
    """Forwards to :data:`EXPORTER`."""
    EXPORTER.resihp_plan_changed(old, new, reason)


@hookimpl
def resihp_iteration_finished(metrics: Any) -> None:
    """Forwards to :data:`EXPORTER`."""
    EXPORTER.resihp_iteration_finished(metrics)


@hookimpl
def resihp_job_started(config: Any, workdir: str) -> None:
    """Serve :data:`EXPORTER` on ``runtime.metrics_host:runtime.metrics_port`` when the
    port is set (0: off)."""
    rt = getattr(config, "runtime", None)
    port = getattr(rt, "metrics_port", 0)
    if port and EXPORTER.port is None:
        bound = EXPORTER.serve(port, getattr(rt, "metrics_host", "127.0.0.1"))
        print(f"prometheus metrics at http://{rt.metrics_host}:{bound}/metrics", flush=True)
