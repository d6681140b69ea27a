"""Job and demo reports: plots, a JSON record and a markdown summary of one run.

:func:`write_report` takes the per-iteration records of a run and its events (fault
injections, detections, plan changes) and writes into ``outdir``:

* ``events.json`` — the title, the events, the iterations and the per-phase statistics
  (indented JSON; a NaN loss is written as ``NaN``, other values JSON cannot hold
  with ``str``);
* ``loss.png`` — loss per iteration, the fault-free reference when given, and a vertical
  line at every plan change;
* ``iteration_time.png`` — seconds per iteration with the events marked: injections red
  dashed, detections (``kind`` ``"failure"`` or ``"detection"``) orange, plan changes
  green, anything else grey dotted, each annotated with its (shortened) text;
* ``throughput.png`` — mean samples/s per phase with 95 % confidence intervals;
* ``summary.md`` — a table of the phases and the list of events.

An *iteration record* is a mapping with keys

``iteration`` (int, strictly increasing), ``loss`` (real number; NaN allowed),
``seconds`` (wall time of the iteration, > 0), ``samples`` (int >= 0: sequences or
micro-batches processed), ``generation`` (plan generation, int >= 0), ``phase`` (non-empty
str, e.g. ``"healthy"``, ``"fail-slow (ResiHP)"``) and optionally ``time`` (seconds since
job start at which the iteration *ended*). Extra keys are kept in ``events.json``.

An *event* is a job event (:data:`resihp_core.protocols.events.JobEvent`) or a mapping
with ``kind`` (str: ``"injection"``, ``"failure"``, ``"plan"``,
...), ``text`` (str), and ``iteration`` (int) or ``time`` (seconds since job start), plus
optionally ``generation`` and anything else. An event given by ``time`` only is placed
on the iteration axis by interpolating over the iterations' end times: their ``time``
keys when every record has one, otherwise the running sum of ``seconds`` (that is, as if
iterations ran back to back from time 0).

Statistics (:func:`summary_table`): phases appear in order of first appearance. A
phase's throughput is the mean over its iterations of ``samples / seconds``; its 95 %
confidence interval is ``mean ± t(0.975, n-1) · s / sqrt(n)`` with ``s`` the sample
standard deviation. The Student-t quantile comes from a table (df 1..30, four decimals)
and, beyond df 30, from the Cornish-Fisher expansion of the t quantile in the normal
quantile (Abramowitz & Stegun 26.7.5; error below 1e-5 there). SciPy is not needed.
A phase of one iteration has no interval (``None``).

Matplotlib is imported only inside :func:`write_report`, and figures are drawn on the
Agg canvas directly (no ``pyplot``), so no global backend is switched.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resihp_core.protocols.events import JobEvent, event_dicts

__all__ = [
    "ReportError",
    "format_table",
    "summary_table",
    "t_quantile_975",
    "write_report",
]


class ReportError(ValueError):
    """The input to a report is empty or malformed; the message names row and key."""


# ----------------------------------------------------------------- statistics
#: Two-sided 95 % Student-t quantiles t(0.975, df) for df = 1..30.
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (>= 1).

    Table for df <= 30; Cornish-Fisher expansion (to 1/df^4) above.
    """
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an int >= 1, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def _mean_ci(values: Sequence[float]) -> tuple[float, float, float | None]:
    """(mean, sample std, 95 % CI half-width or None when n < 2)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0, None
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, sd, t_quantile_975(n - 1) * sd / math.sqrt(n)


# ----------------------------------------------------------------- validation
def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _need(row: Mapping[str, Any], where: str, key: str) -> Any:
    if key not in row:
        raise ReportError(f"{where}: missing key {key!r} (has: {', '.join(map(str, row)) or 'nothing'})")
    return row[key]


def _check_iterations(iterations: object) -> list[dict[str, Any]]:
    if isinstance(iterations, (str, bytes)) or not isinstance(iterations, Sequence):
        raise ReportError(f"iterations must be a list of dicts, got {type(iterations).__name__}")
    if len(iterations) == 0:
        raise ReportError("iterations is empty: nothing to report (no iteration completed)")
    rows: list[dict[str, Any]] = []
    prev: int | None = None
    for i, row in enumerate(iterations):
        where = f"iterations[{i}]"
        if not isinstance(row, Mapping):
            raise ReportError(f"{where}: expected a dict, got {type(row).__name__}")
        it = _need(row, where, "iteration")
        if not _is_int(it) or it < 0:
            raise ReportError(f"{where}: key 'iteration' must be an int >= 0, got {it!r}")
        if prev is not None and it <= prev:
            raise ReportError(
                f"{where}: key 'iteration' must increase strictly, got {it} after {prev}"
            )
        prev = it
        loss = _need(row, where, "loss")
        if not _is_real(loss):
            raise ReportError(f"{where}: key 'loss' must be a number, got {loss!r}")
        sec = _need(row, where, "seconds")
        if not _is_real(sec) or not math.isfinite(sec) or sec <= 0:
            raise ReportError(f"{where}: key 'seconds' must be a finite number > 0, got {sec!r}")
        samples = _need(row, where, "samples")
        if not _is_int(samples) or samples < 0:
            raise ReportError(f"{where}: key 'samples' must be an int >= 0, got {samples!r}")
        gen = _need(row, where, "generation")
        if not _is_int(gen) or gen < 0:
            raise ReportError(f"{where}: key 'generation' must be an int >= 0, got {gen!r}")
        phase = _need(row, where, "phase")
        if not isinstance(phase, str) or not phase.strip():
            raise ReportError(f"{where}: key 'phase' must be a non-empty string, got {phase!r}")
        if "time" in row:
            t = row["time"]
            if not _is_real(t) or not math.isfinite(t) or t < 0:
                raise ReportError(f"{where}: key 'time' must be a finite number >= 0, got {t!r}")
        clean = dict(row)  # plain Python values (numpy scalars pass the checks above)
        clean.update(iteration=int(it), loss=float(loss), seconds=float(sec),
                     samples=int(samples), generation=int(gen))
        if "time" in row:
            clean["time"] = float(row["time"])
        rows.append(clean)
    return rows


@dataclass(frozen=True)
class _Event:
    """One checked event: what the figures and the summary read; ``record`` is what
    ``events.json`` keeps."""

    kind: str
    text: str
    iteration: int | None
    time: float | None
    generation: int | None
    record: dict[str, Any]

    def when(self) -> str:
        parts = []
        if self.time is not None:
            parts.append(f"t={self.time:.2f}s")
        if self.iteration is not None:
            parts.append(f"it {self.iteration}")
        return " / ".join(parts)


def _check_events(events: object) -> list[_Event]:
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise ReportError(f"events must be a list of dicts, got {type(events).__name__}")
    out: list[_Event] = []
    for i, ev in enumerate(events):
        if isinstance(ev, JobEvent):
            ev = event_dicts([ev])[0]
        where = f"events[{i}]"
        if not isinstance(ev, Mapping):
            raise ReportError(f"{where}: expected a dict, got {type(ev).__name__}")
        kind = _need(ev, where, "kind")
        if not isinstance(kind, str) or not kind:
            raise ReportError(f"{where}: key 'kind' must be a non-empty string, got {kind!r}")
        text = _need(ev, where, "text")
        if not isinstance(text, str):
            raise ReportError(f"{where}: key 'text' must be a string, got {text!r}")
        if "iteration" not in ev and "time" not in ev:
            raise ReportError(f"{where}: needs key 'iteration' or key 'time'")
        if "iteration" in ev and (not _is_int(ev["iteration"]) or ev["iteration"] < 0):
            raise ReportError(f"{where}: key 'iteration' must be an int >= 0, got {ev['iteration']!r}")
        if "time" in ev:
            t = ev["time"]
            if not _is_real(t) or not math.isfinite(t) or t < 0:
                raise ReportError(f"{where}: key 'time' must be a finite number >= 0, got {t!r}")
        if "generation" in ev and (not _is_int(ev["generation"]) or ev["generation"] < 0):
            raise ReportError(
                f"{where}: key 'generation' must be an int >= 0, got {ev['generation']!r}"
            )
        clean = dict(ev)
        for key, conv in (("iteration", int), ("time", float), ("generation", int)):
            if key in clean:
                clean[key] = conv(clean[key])
        out.append(_Event(kind, text, clean.get("iteration"), clean.get("time"), clean.get("generation"), clean))
    return out


def _check_reference(reference: object) -> list[float] | None:
    if reference is None:
        return None
    if isinstance(reference, (str, bytes)) or not isinstance(reference, Sequence):
        raise ReportError(f"reference_losses must be a list of numbers, got {type(reference).__name__}")
    for i, v in enumerate(reference):
        if not _is_real(v):
            raise ReportError(f"reference_losses[{i}]: must be a number, got {v!r}")
    return [float(v) for v in reference]


# ----------------------------------------------------------------- tables
def summary_table(iterations: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per-phase statistics, phases in order of first appearance.

    Each row: ``phase``, ``iterations`` (count), ``first_iteration``, ``last_iteration``,
    ``generations`` (sorted list), ``samples`` (total), ``total_seconds``,
    ``mean_seconds``, ``std_seconds`` (sample std, 0 for one iteration),
    ``throughput`` (mean samples/s over the phase's iterations), ``throughput_std``,
    ``throughput_ci`` (95 % half-width, None for one iteration), ``t_quantile`` (used
    for the interval, None for one iteration), ``relative`` (throughput / the first
    phase's throughput; None when that is 0).

    :raises ReportError: empty or malformed ``iterations`` (naming row index and key).
    """
    rows = _check_iterations(iterations)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["phase"], []).append(r)
    out: list[dict[str, Any]] = []
    for phase, rs in groups.items():
        secs = [float(r["seconds"]) for r in rs]
        tput = [r["samples"] / float(r["seconds"]) for r in rs]
        mean_s, sd_s, _ = _mean_ci(secs)
        mean_t, sd_t, ci_t = _mean_ci(tput)
        out.append({
            "phase": phase,
            "iterations": len(rs),
            "first_iteration": rs[0]["iteration"],
            "last_iteration": rs[-1]["iteration"],
            "generations": sorted({r["generation"] for r in rs}),
            "samples": sum(r["samples"] for r in rs),
            "total_seconds": math.fsum(secs),
            "mean_seconds": mean_s,
            "std_seconds": sd_s,
            "throughput": mean_t,
            "throughput_std": sd_t,
            "throughput_ci": ci_t,
            "t_quantile": t_quantile_975(len(rs) - 1) if len(rs) > 1 else None,
        })
    base = out[0]["throughput"]
    for row in out:
        row["relative"] = row["throughput"] / base if base > 0 else None
    return out


def _fmt_tput(row: Mapping[str, Any]) -> str:
    ci = row.get("throughput_ci")
    return f"{row['throughput']:.3f}" + (f" ± {ci:.3f}" if ci is not None else " (n=1)")


def _fmt_rel(row: Mapping[str, Any]) -> str:
    rel = row.get("relative")
    return "-" if rel is None else f"{rel:.2f}x"


def _table_cells(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["phase", "iterations", "generations", "mean iter s", "samples/s (95% CI)", "vs first"]
    body = [
        [
            str(r["phase"]),
            str(r["iterations"]),
            ",".join(str(g) for g in r["generations"]),
            f"{r['mean_seconds']:.4f}",
            _fmt_tput(r),
            _fmt_rel(r),
        ]
        for r in rows
    ]
    return header, body


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows from :func:`summary_table` as an aligned plain-text table (no trailing newline)."""
    header, body = _table_cells(rows)
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    right = [False, True, False, True, True, True]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            (c.rjust(w) if r else c.ljust(w)) for c, w, r in zip(cells, widths, right)
        ).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(b) for b in body)])


def _markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header, body = _table_cells(rows)

    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---", "---:", "---", "---:", "---:", "---:"]) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in b) + " |" for b in body]
    return "\n".join(lines)


# ----------------------------------------------------------------- events
_STYLE = {  # kind -> (colour, line style, legend label)
    "injection": ("red", "--", "injection"),
    "failure": ("orange", "-", "detection"),
    "detection": ("orange", "-", "detection"),
    "plan": ("green", "-", "plan change"),
}
_OTHER = ("grey", ":", "other event")


def _event_x(events: list[_Event], rows: list[dict[str, Any]]) -> list[float]:
    """Each event's position on the iteration axis (see the module doc)."""
    its = [float(r["iteration"]) for r in rows]
    if all("time" in r for r in rows):
        ends = [float(r["time"]) for r in rows]
    else:
        ends, acc = [], 0.0
        for r in rows:
            acc += float(r["seconds"])
            ends.append(acc)
    # Iteration k spans (end of k-1, end of k]; time 0 is the start of the first one.
    starts_t = [ends[0] - float(rows[0]["seconds"])] + ends[:-1]
    xs: list[float] = []
    for ev in events:
        if ev.iteration is not None:
            xs.append(float(ev.iteration))
            continue
        t = float(ev.time or 0.0)
        if t <= starts_t[0]:
            xs.append(its[0] - 0.5)
        elif t >= ends[-1]:
            xs.append(its[-1] + 0.5)
        else:
            k = next(j for j, e in enumerate(ends) if t <= e)
            span = ends[k] - starts_t[k]
            frac = (t - starts_t[k]) / span if span > 0 else 1.0
            xs.append(its[k] - 0.5 + frac)
    return xs


def _short(text: str, n: int = 28) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _wrap(text: str, width: int) -> str:
    """``text`` on lines of at most ``width`` characters (words kept whole when they fit)."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=True)) or text


# ----------------------------------------------------------------- plotting
def _figure(width: float = 8.0, height: float = 4.5) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _mark_events(ax: Any, events: list[_Event], xs: list[float], *, annotate: bool,
                 kinds: set[str] | None = None) -> None:
    seen: set[str] = set()
    marked = [(x, ev) for ev, x in zip(events, xs) if kinds is None or ev.kind in kinds]
    for x, ev in marked:
        colour, style, label = _STYLE.get(ev.kind, _OTHER)
        ax.axvline(x, color=colour, linestyle=style, linewidth=1.2, alpha=0.85,
                   label=None if label in seen else label)
        seen.add(label)
    if not annotate:
        return
    # Vertical labels of events a few iterations apart (injection, detection, plan
    # change) would print on top of each other: each label starts at least one line
    # height right of the previous one, with a thin leader back to its event's line.
    lo, hi = ax.get_xlim()
    width_pt = ax.figure.get_figwidth() * 72 * ax.get_position().width
    per_unit = width_pt / (hi - lo) if hi > lo else 0.0
    line_pt, last = 11.0, -math.inf
    for x, ev in sorted(((x, ev) for x, ev in marked if ev.text), key=lambda t: t[0]):
        colour = _STYLE.get(ev.kind, _OTHER)[0]
        at = (x - lo) * per_unit
        pos = max(at + 2.0, last + line_pt)
        last = pos
        ax.annotate(_short(ev.text), xy=(x, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(pos - at, -4), textcoords="offset points", rotation=90,
                    va="top", ha="left", fontsize=7, color=colour,
                    bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8),
                    arrowprops=(None if pos - at <= 2.0 else
                                dict(arrowstyle="-", color=colour, linewidth=0.5, alpha=0.6)))


def _plot_loss(path: Path, rows: list[dict[str, Any]], events: list[_Event],
               xs: list[float], reference: list[float] | None, title: str) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot([r["iteration"] for r in rows], [float(r["loss"]) for r in rows],
            color="tab:blue", linewidth=1.5, label="this run")
    if reference:
        x0 = rows[0]["iteration"]
        ax.plot([x0 + j for j in range(len(reference))], reference, color="black",
                linestyle="--", linewidth=1.0, alpha=0.8, label="fault-free reference")
    _mark_events(ax, events, xs, annotate=False, kinds={"plan"})
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: loss")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _plot_iteration_time(path: Path, rows: list[dict[str, Any]], events: list[_Event],
                         xs: list[float], title: str) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot([r["iteration"] for r in rows], [float(r["seconds"]) for r in rows],
            color="tab:blue", marker="o", markersize=2.5, linewidth=1.0, label="iteration time")
    # Headroom above the slowest iteration: the event labels hang there, clear of the data.
    ax.set_ylim(bottom=0, top=1.7 * max(float(r["seconds"]) for r in rows))
    _mark_events(ax, events, xs, annotate=True)
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"{title}: iteration time")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _plot_throughput(path: Path, table: list[dict[str, Any]], title: str) -> None:
    # Phase names are wrapped to the bar's width, so neighbouring labels never collide.
    fig = _figure(max(6.0, 1.9 * len(table) + 2.0), 4.8)
    ax = fig.add_subplot()
    xs = list(range(len(table)))
    means = [r["throughput"] for r in table]
    errs = [r["throughput_ci"] or 0.0 for r in table]
    colours = ["tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown",
               "tab:pink", "tab:olive", "tab:cyan", "tab:grey"]
    bars = ax.bar(xs, means, yerr=errs, capsize=5,
                  color=[colours[i % len(colours)] for i in xs], alpha=0.85)
    for b, r in zip(bars, table):
        ax.annotate(_fmt_tput(r), xy=(b.get_x() + b.get_width() / 2, b.get_height()),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(xs)
    ax.set_xticklabels([_wrap(str(r["phase"]), 18) + f"\n(n={r['iterations']})" for r in table], fontsize=8)
    ax.set_ylabel("samples / s (mean, 95% CI)")
    ax.set_title(f"{title}: throughput per phase")
    ax.set_ylim(bottom=0, top=max([m + e for m, e in zip(means, errs)] + [1e-9]) * 1.15)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


# ----------------------------------------------------------------- markdown
def _summary_md(title: str, table: list[dict[str, Any]], rows: list[dict[str, Any]],
                events: list[_Event], reference: list[float] | None) -> str:
    out = [f"# {title}", ""]
    total = math.fsum(float(r["seconds"]) for r in rows)
    out.append(f"{len(rows)} iterations ({rows[0]['iteration']}..{rows[-1]['iteration']}), "
               f"{total:.2f} s of iteration time, {len(events)} events.")
    out += ["", "## Phases", "", _markdown_table(table), ""]
    out.append("Throughput is the mean over the phase's iterations of samples/s; ± is the "
               "95 % confidence half-width, t(0.975, n-1)·s/√n (t from a table up to df 30, "
               "Cornish-Fisher expansion beyond). \"vs first\" is relative to the first phase.")
    if reference:
        x0 = rows[0]["iteration"]
        diffs = [abs(float(r["loss"]) - reference[r["iteration"] - x0]) for r in rows
                 if 0 <= r["iteration"] - x0 < len(reference)]
        diffs = [d for d in diffs if math.isfinite(d)]
        if diffs:
            out += ["", f"Loss vs fault-free reference over {len(diffs)} iterations: "
                        f"max |Δ| = {max(diffs):.4g}, mean |Δ| = {math.fsum(diffs) / len(diffs):.4g}."]
    out += ["", "## Events", ""]
    if not events:
        out.append("None.")
    for ev in events:
        gen = f" gen {ev.generation}" if ev.generation is not None else ""
        text = " ".join(ev.text.split())
        out.append(f"- {ev.when()} **{ev.kind}**{gen}: {text}")
    out += ["", "Figures: `loss.png`, `iteration_time.png`, `throughput.png`; data: `events.json`.", ""]
    return "\n".join(out)


# ----------------------------------------------------------------- entry point
def write_report(
    outdir: str | Path,
    *,
    iterations: list[dict],
    events: Sequence[JobEvent | Mapping[str, Any]],
    reference_losses: list[float] | None = None,
    title: str = "ResiHP run",
) -> dict[str, Path]:
    """Write the report files into ``outdir`` (created if needed) and return their paths,
    keyed ``"events"``, ``"loss"``, ``"iteration_time"``, ``"throughput"``, ``"summary"``.

    :param iterations: one record per completed iteration (see the module doc).
    :param events: injections, detections, plan changes, ... (see the module doc).
    :param reference_losses: the fault-free run's loss; element ``j`` belongs to iteration
        ``iterations[0]["iteration"] + j``.
    :param title: used in figure titles and the summary heading.
    :raises ReportError: empty or malformed input, naming the row index and key.
    """
    rows = _check_iterations(iterations)
    evs = _check_events(events)
    ref = _check_reference(reference_losses)
    table = summary_table(rows)
    xs = _event_x(evs, rows)

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "events": out / "events.json",
        "loss": out / "loss.png",
        "iteration_time": out / "iteration_time.png",
        "throughput": out / "throughput.png",
        "summary": out / "summary.md",
    }
    record = {"title": title, "events": [e.record for e in evs], "iterations": rows, "phases": table}
    paths["events"].write_text(
        json.dumps(record, indent=2, default=str, allow_nan=True) + "\n", encoding="utf-8"
    )
    _plot_loss(paths["loss"], rows, evs, xs, ref, title)
    _plot_iteration_time(paths["iteration_time"], rows, evs, xs, title)
    _plot_throughput(paths["throughput"], table, title)
    paths["summary"].write_text(_summary_md(title, table, rows, evs, ref), encoding="utf-8")
    return paths
