"""The ``resihp`` command.

Subcommands live in :data:`COMMANDS` (name -> :class:`Command`); adding one is adding an
entry. Command modules that need heavy imports (torch, the runtime) import them inside
their ``run`` function so ``resihp --help`` and ``resihp plugins`` stay fast.

Exit codes: 0 success, 1 runtime failure (e.g. a plugin failed to load), 2 bad usage or
bad input file.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

__all__ = ["COMMANDS", "CliError", "Command", "build_parser", "main"]


class CliError(Exception):
    """A user-facing error: printed as ``resihp: error: ...``, exits with ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Command:
    """A subcommand: ``configure`` adds its arguments, ``run`` does it and returns the
    exit code."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


# ------------------------------------------------------------------ plugins
def _configure_plugins(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _plugins_report() -> dict[str, Any]:
    from resihp_core.plugins import PluginError, get_plugins

    try:
        plugins = get_plugins()
        adapters = plugins.adapters()
        detectors = plugins.changepoint_detectors()
        verifiers = plugins.verification_strategies()
        stages = plugins.adaptation_stages()
        sources = plugins.data_sources()
    except PluginError as e:
        raise CliError(str(e), code=1) from e
    overridden = [
        {"kind": reg.kind, "name": r.name, "source": r.source, "by": reg.source_of(r.name)}
        for reg in (adapters, detectors, verifiers, stages, sources)
        for r in reg.shadowed()
    ]
    return {
        "autoload": plugins.autoload,
        "blocked": sorted(plugins.blocked),
        "plugins": [asdict(i) for i in plugins.info()],
        "adapters": [
            {
                "name": r.name,
                "source": r.source,
                "target": r.value.target_path,
                "description": r.value.description,
                "capabilities": r.value.capabilities.to_dict(),
                "default": r.value.default,
            }
            for r in adapters.registrations()
        ],
        "changepoint_detectors": [{"name": r.name, "source": r.source} for r in detectors.registrations()],
        "verification_strategies": [{"name": r.name, "source": r.source} for r in verifiers.registrations()],
        "adaptation_stages": [
            {"name": s.name, "order": s.order, "source": stages.source_of(s.name)} for s in stages.ordered()
        ],
        "data_sources": [{"name": r.name, "source": r.source} for r in sources.registrations()],
        "overridden": overridden,
    }


def _cmd_plugins(args: argparse.Namespace) -> int:
    rep = _plugins_report()
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    yes = lambda b: "yes" if b else "-"  # noqa: E731
    out = ["Plugins" + ("" if rep["autoload"] else " (entry-point autoload disabled)")]
    out.append(_table(
        ["name", "source", "module", "distribution"],
        [[p["name"], p["source"], p["module"],
          f"{p['distribution']} {p['version']}" if p["distribution"] else "-"] for p in rep["plugins"]],
    ) if rep["plugins"] else "  (none)")
    if rep["blocked"]:
        out.append("blocked: " + ", ".join(rep["blocked"]))
    out += ["", "Adapters"]
    out.append(_table(
        ["name", "tp_resize", "hetero_tp", "layer_repart", "migration", "checkpoint", "schedules", "plugin", "target"],
        [[a["name"] + (" (default)" if a["default"] else ""),
          *(yes(c[k]) + ("" if c.get("tp_with_dp", True) or not c[k] else " (dp=1)")
            for k in ("tp_resize", "heterogeneous_tp")), yes(c["layer_repartition"]),
          "whole mb" if c.get("uneven_dp") and not c["cross_replica_migration"] else yes(c["cross_replica_migration"]),
          yes(c["checkpoint"]), ",".join(c["schedules"]),
          a["source"], a["target"]]
         for a in rep["adapters"] for c in [a["capabilities"]]],
    ) if rep["adapters"] else "  (none)")
    out.append("")
    for key, title in [("changepoint_detectors", "Change-point detectors"),
                       ("verification_strategies", "Verification strategies"),
                       ("adaptation_stages", "Adaptation stages (in order)"),
                       ("data_sources", "Data sources")]:
        names = ", ".join(f"{e['name']} ({e['source']})" for e in rep[key]) or "(none)"
        out.append(f"{title}: {names}")
    for o in rep["overridden"]:
        out.append(f"overridden: {o['kind']} {o['name']!r} from {o['source']} by {o['by']}")
    print("\n".join(out))
    return 0


# --------------------------------------------------------------------- plan
def _configure_plan(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="plan_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="parse a plan text file and print its grid")
    show.add_argument("file", help="plan in the 'resihp-plan v1' text form")


def _cmd_plan(args: argparse.Namespace) -> int:
    from resihp_core.plan import PlanError, parse_plan

    if args.plan_command == "show":
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"cannot read plan file {args.file!r}: {e}") from e
        try:
            plan = parse_plan(text)
        except PlanError as e:
            raise CliError(f"{args.file}: {e}") from e
        print(plan.grid())
        return 0
    raise CliError(f"unknown plan action {args.plan_command!r}")


# --------------------------------------------------------------------- agent
def _configure_agent(p: argparse.ArgumentParser) -> None:
    from resihp_core.runtime.agent import configure

    configure(p)


def _cmd_agent(args: argparse.Namespace) -> int:
    from resihp_core.runtime.agent import run

    return run(args)


def _configure_run(p: argparse.ArgumentParser) -> None:
    from resihp_core.cli.run import configure_run

    configure_run(p)


def _cmd_run(args: argparse.Namespace) -> int:
    from resihp_core.cli.run import run_config

    return run_config(args)


# ------------------------------------------------------------------ simulate
def _configure_simulate(p: argparse.ArgumentParser) -> None:
    from resihp_core.sim.cli import configure

    configure(p)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from resihp_core.sim.cli import run

    return run(args)


COMMANDS: dict[str, Command] = {
    "agent": Command("serve as a node agent: launch and watch this host's workers for a controller",
                     _configure_agent, _cmd_agent),
    "plugins": Command("list loaded plugins and registered adapters", _configure_plugins, _cmd_plugins),
    "plan": Command("inspect parallel plans", _configure_plan, _cmd_plan),
    "run": Command("run a resilient job from a configuration file", _configure_run, _cmd_run),
    "simulate": Command("simulate ResiHP and the comparison systems on a failure trace (cluster scale)",
                        _configure_simulate, _cmd_simulate),
}


def _plugin_commands() -> dict[str, Command]:
    """Subcommands registered through ``resihp_register_commands`` (e.g. ``demo``). A
    plugin that fails to load only costs its commands: the message says which."""
    from resihp_core.plugins import PluginError, get_plugins

    try:
        registry = get_plugins().commands()
    except PluginError as e:
        print(f"resihp: warning: plugin commands unavailable: {e}", file=sys.stderr)
        return {}
    return {r.name: Command(r.value.help, r.value.configure, r.value.run) for r in registry.registrations()}


def build_parser() -> argparse.ArgumentParser:
    from resihp_core import __version__

    parser = argparse.ArgumentParser(
        prog="resihp", description="Resilient hybrid-parallel (TP x PP x DP) LLM training."
    )
    parser.add_argument("--version", action="version", version=f"resihp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = dict(COMMANDS)
    for name, cmd in _plugin_commands().items():
        commands.setdefault(name, cmd)
    for name, cmd in commands.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``resihp`` command; returns the exit code instead of exiting."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help / --version (0) or bad usage (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args._run(args))
    except CliError as e:
        print(f"resihp: error: {e}", file=sys.stderr)
        return e.code
