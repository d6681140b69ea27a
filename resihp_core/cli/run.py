"""``resihp run CONFIG``: a job assembled from its configuration, run resiliently on
this machine (or with external agents), with a live view, a report folder and an exit
status that is non-zero whenever the run or its correctness check failed.
:func:`run_controlled` is the controller's part, shared with ``resihp launch``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from resihp_core.cli import CliError
from resihp_core.protocol import FailureReport
from resihp_core.protocols.events import Event, IterationMetrics, JobEvent, event_dicts
from resihp_core.runtime.controller.assemble import AssembledJob, assemble
from resihp_core.runtime.controller.jobs import check_backend_here, check_fits_here, phases, report_events
from resihp_core.runtime.controller.runconfig import AgentSetup, RunHooks

if TYPE_CHECKING:
    from resihp_core.config import Config
    from resihp_core.faults import Fault
    from resihp_core.job import JobSpec
    from resihp_core.runtime.failover import JobState
    from resihp_core.runtime.controller.resilient import ResilientRun

__all__ = ["configure_run", "run_config", "run_controlled", "run_job", "work_folder"]


def run_config(args: argparse.Namespace) -> int:
    """``resihp run CONFIG [--faults FILE]``."""
    from resihp_core.config import ConfigError, load_config
    from resihp_core.faults import FaultError, load_scenario

    try:
        cfg = load_config(args.config)
        devices = range(cfg.runtime.nodes * cfg.runtime.devices_per_node)
        faults = load_scenario(args.faults, devices=devices, iterations=cfg.training.iterations) if args.faults else []
        check_fits_here(cfg, getattr(args, "agents", "local"))
        check_backend_here(cfg, getattr(args, "agents", "local"))
        work = work_folder(args, "run")
        job = assemble(cfg, faults, work)  # every check before anything starts; the one assembly of the run
    except (ConfigError, FaultError) as e:
        raise CliError(str(e)) from e
    p = cfg.parallel
    return run_job(cfg, faults, args, f"resihp run: TP{p.tp} x PP{p.pp} x DP{p.dp}", "run", job=job, work=work)


def work_folder(args: argparse.Namespace, tag: str) -> Path:
    """``--workdir`` (made if missing), else a fresh temporary folder."""
    if getattr(args, "workdir", None):
        work = Path(args.workdir).resolve()
        work.mkdir(parents=True, exist_ok=True)
        return work
    return Path(tempfile.mkdtemp(prefix=f"resihp-{tag}-"))


def _agents(cfg: Config, args: argparse.Namespace) -> tuple[AgentSetup, Callable[[str, list[int]], None] | None]:
    """How ``run_resilient`` gets its agents: started here, or on each host by the user
    (then also what to tell the user once the controller listens)."""
    import os

    from resihp_core.runtime.heartbeat import parse_address

    rt = cfg.runtime
    interface = getattr(args, "interface", None) or rt.interface
    if getattr(args, "agents", "local") == "local":
        return AgentSetup(interface=interface), None
    secret = rt.secret or os.environ.get("RESIHP_SECRET", "")
    if not secret:
        raise CliError("--agents external needs the job secret: set runtime.secret or RESIHP_SECRET")
    try:
        listen = parse_address(args.listen) if args.listen else (rt.controller_host, rt.controller_port)
    except ValueError as e:
        raise CliError(f"--listen: {e}") from e
    if isinstance(listen, str):
        raise CliError("--listen takes host:port")

    def tell(address: str, nodes: list[int]) -> None:
        print(f"controller listening on {address}; waiting for the agents of nodes {nodes}. On each host run:\n"
              f"  RESIHP_SECRET=<the job secret> resihp agent --controller <this host>:{address.rsplit(':', 1)[1]} "
              f"--node <N>\n"
              f"(or give each host only its node's credential, RESIHP_NODE_KEY=<node_credential(secret, N)>)",
              flush=True)

    return AgentSetup(mode="external", listen=listen, secret=secret, timeout_s=args.agent_timeout,
                      interface=interface), tell


def _reference_check(cfg: Config, losses: list[float], reference: list[float]) -> tuple[float, int, float]:
    """Worst relative loss difference over the horizon where a fault-free reference is
    meaningful: every iteration in float64; in float32 the first 20 (two equal float32
    runs drift apart later through chaotic growth of rounding differences). Returns
    (worst, horizon, tolerance)."""
    horizon, tol = (len(losses), 1e-9) if cfg.training.dtype == "float64" else (min(len(losses), 20), 1e-3)
    worst = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[:horizon], reference)), default=0.0)
    return worst, horizon, tol


def _failover_secret(cfg: Config, work: Path) -> str:
    """The job secret a restarted controller can find again: ``runtime.secret`` or
    ``RESIHP_SECRET`` if given, else the work folder's ``job.secret`` (made once)."""
    import os

    from resihp_core.runtime.failover import StateError, job_secret

    given = cfg.runtime.secret or os.environ.get("RESIHP_SECRET", "")
    if given:
        return given
    try:
        return job_secret(work, create=True)
    except StateError as e:
        raise CliError(str(e), code=1) from None


def _attachable(args: argparse.Namespace, work: Path, secret: str) -> JobState | None:
    """``--resume`` of a job that outlived its controller: its authenticated state, to
    re-attach to its live workers (docs/failover.md); None: restore from a checkpoint."""
    from resihp_core.runtime.failover import STATE_FILE, StateError, read_state

    if not secret or not (work / STATE_FILE).exists():
        return None
    try:
        state = read_state(work, secret)
    except StateError as e:
        print(f"{'resume: not re-attaching' if getattr(args, 'resume', False) else 'note'}: {e}", flush=True)
        return None
    if not getattr(args, "resume", False):
        if _store_answers(state.store_address, secret):
            raise CliError(f"the job in {work} is still running without a controller (its job store at "
                           f"{state.store_address} answers): re-attach to it with --resume, or wait until its "
                           "grace period is over (runtime.controller_grace_s)", code=1)
        return None
    print(f"resume: re-attaching to the job's live workers (generation {state.generation}, store at "
          f"{state.store_address})", flush=True)
    return state


def _store_answers(address: str, secret: str) -> bool:
    """Whether a job store at ``address`` accepts this controller (the job secret)."""
    from resihp_core.runtime.controller.resilient import connect_store

    try:
        connect_store(address, secret, timeout=5.0, connect_timeout=1.0).close()
    except Exception:  # noqa: BLE001 - gone, or not this job's
        return False
    return True


def _resume_point(cfg: Config, args: argparse.Namespace, spec: JobSpec) -> tuple[int, int | None]:
    """``--resume``: the first iteration to train and the checkpoint to load, from the
    newest complete checkpoint in the job's checkpoint folder (docs/checkpoints.md)."""
    from resihp_core import checkpoints

    if not getattr(args, "resume", False):
        return 0, None
    if not getattr(args, "workdir", None) and not cfg.training.checkpoint_dir:
        raise CliError("--resume needs the interrupted run's checkpoints: pass its --workdir "
                       "or set training.checkpoint_dir")
    it, skipped = checkpoints.newest_complete(spec.checkpoint_dir)
    for s in skipped:
        print(f"resume: checkpoint of iteration {s.iteration} is not usable ({s.problem})", flush=True)
    if it is None:
        print(f"resume: no complete checkpoint in {spec.checkpoint_dir}: starting from the initial state", flush=True)
        return 0, None
    if it + 1 >= cfg.training.iterations:
        raise CliError(f"--resume: the checkpoint of iteration {it} in {spec.checkpoint_dir} is already the "
                       f"job's last (training.iterations = {cfg.training.iterations}): nothing to do")
    print(f"resume: from the checkpoint of iteration {it}; training iterations {it + 1}.."
          f"{cfg.training.iterations - 1}", flush=True)
    return it + 1, it


def run_controlled(cfg: Config, job: AssembledJob, work: Path, args: argparse.Namespace, *,
                   worker_module: str = "resihp_core.runtime.worker", timeout_s: float | None = None,
                   hooks: RunHooks = RunHooks()) -> tuple[ResilientRun, int]:
    """The controller's part of a run, shared by ``resihp run`` and ``resihp launch``:
    one controller per job (its lock in ``work``), a job secret a restarted controller
    finds again, and ``--resume``: re-attach to the job's live agents and workers
    (docs/failover.md), else restore from the newest complete checkpoint. Runs
    ``job.run`` (from :func:`assemble`) with the agents of ``args``, ``hooks`` and
    ``timeout_s``; returns the run and the first iteration it trained."""
    from resihp_core.runtime.failover import ControllerLock, ControllerRunning
    from resihp_core.runtime.controller.resilient import AttachFailed, Resume, run_resilient

    try:
        lock = ControllerLock(work).acquire()  # one controller per job, released when this process ends
    except ControllerRunning as e:
        raise CliError(str(e), code=1) from None
    try:
        agents, tell = _agents(cfg, args)
        if job.run.controller_grace_s > 0 and not agents.secret:
            agents = replace(agents, secret=_failover_secret(cfg, work))
        if tell is not None:
            hooks = replace(hooks, on_listening=tell)
        attach = _attachable(args, work, agents.secret)
        start, restore = (0, None) if attach is not None else _resume_point(cfg, args, job.spec)
        print(f"working folder {work} (worker logs in job/, checkpoints in {job.spec.checkpoint_dir}, every "
              f"{cfg.training.checkpoint_every} iteration(s), newest {cfg.training.checkpoint_keep or 'all'} kept"
              + (f"; memory copies on peers every {cfg.training.memory_copy_every} iteration(s)"
                 if cfg.training.memory_copy_every else "") + ")",
              flush=True)
        config = replace(job.run, worker_module=worker_module, agents=agents, hooks=hooks, workdir=work / "job",
                         state_dir=work, timeout_s=job.run.timeout_s if timeout_s is None else timeout_s)
        run = None
        if attach is not None:
            try:
                run = run_resilient(replace(config, resume=Resume(attach=attach)))
                start = run.extra.get("first", 0)
            except AttachFailed as e:
                print(f"resume: cannot re-attach to the running job ({e}): restoring from a checkpoint", flush=True)
                start, restore = _resume_point(cfg, args, job.spec)
        if run is None:
            run = run_resilient(replace(config, resume=Resume(start=start, restore=restore)))
    finally:
        lock.release()
    return run, start


def run_job(cfg: Config, faults: list[Fault], args: argparse.Namespace, title: str, tag: str, *,
            job: AssembledJob | None = None, work: Path | None = None) -> int:
    """Run ``cfg`` with ``faults``, show it live, write the report; the exit status is 1
    when the run failed or its losses differ from the fault-free reference. ``job`` and
    ``work``: the run's assembly and folder, if the caller made them already."""
    from resihp_core.report import format_table, summary_table, write_report

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outdir = Path(args.report) / f"{tag}-{stamp}"
    outdir.mkdir(parents=True, exist_ok=True)
    work = work or work_folder(args, tag)
    job = job or assemble(cfg, faults, work)
    health = {d: "ok" for d in job.plan.devices()}

    from resihp_core.runtime.controller.console import RunLog, finish, one_line

    view = _View(args, health)
    phase_of = phases(faults)
    log = RunLog(work)
    print(f"run log: {log.path}", flush=True)

    def observe(ev: Event) -> None:
        if isinstance(ev, FailureReport):
            for d in ev.devices:
                health[d] = "DEAD" if ev.failure == "fail-stop" else f"slow {ev.cause}"
        elif isinstance(ev, IterationMetrics):
            view.iteration(ev)
        elif isinstance(ev, JobEvent):
            phase_of.event(ev)  # a detected failure starts a phase too
            log.write(event_dicts([ev])[0])
            view.event(ev)

    with view:
        run, start = run_controlled(cfg, job, work, args, hooks=RunHooks(phase_of=phase_of, observe=observe))
    if run.job_error is not None:
        return finish(run, log, what=tag, iterations=cfg.training.iterations, start=start)
    if not run.ok:
        print(f"{tag} failed: {run.error}\nrun log: {log.path}; worker logs: {run.logs}", file=sys.stderr)
    log.close(run.events)
    records = run.records
    if not records:
        if run.ok and start >= cfg.training.iterations:  # re-attached to a job that had committed everything
            print(f"the job had already committed all {cfg.training.iterations} iterations: finished", flush=True)
            return 0
        return 1
    ref_losses = job.reference(job.spec, start + len(records))[start:] if job.reference is not None else None
    # Iteration 0 carries process start-up (imports, rendezvous): it is marked as an
    # event, not put in the per-phase throughput or the iteration-time trace.
    iterations = [dict(iteration=r.iteration, loss=r.loss, seconds=r.seconds, samples=r.samples,
                       generation=r.generation, phase=r.phase) for r in records[1:]]
    paths = write_report(outdir, iterations=iterations, events=report_events(run, faults),
                         reference_losses=ref_losses[1:] if ref_losses else None, title=title)
    print()
    print(format_table(summary_table(iterations)))
    ok = run.ok
    if ref_losses is not None:
        worst, horizon, tol = _reference_check(cfg, [r.loss for r in records], ref_losses)
        verdict = "ok" if worst <= tol else "WRONG"
        ok = ok and worst <= tol
        print(f"\nloss vs fault-free reference: max relative difference {worst:.2e} over {horizon} iterations "
              f"({cfg.training.dtype}, tolerance {tol:g}): {verdict}")
    else:
        print(f"\nadapter {job.spec.adapter!r} has no fault-free reference: losses not checked")
    print("events:")
    for ev in run.job_events:
        print(one_line(f"  iteration {ev.iteration:>3}  {ev.kind:<8} {ev.text}", where=str(log.path)))
    print(f"\nreport: {outdir}\nrun log: {log.path}")
    for name, p in paths.items():
        print(f"  {name}: {p}")
    return 0 if ok else 1


class _View:
    """Live terminal view (rich) of iterations, throughput, generation and health."""

    def __init__(self, args: argparse.Namespace, health: dict[int, str]) -> None:
        self.args, self.health = args, health
        self.last: dict = {}
        self.lines: list[str] = []
        self.live = None

    def __enter__(self):
        if not self.args.no_live and sys.stdout.isatty():
            from rich.live import Live

            self.live = Live(self._render(), refresh_per_second=8, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def _render(self):
        from rich.table import Table

        t = Table(title="resihp demo — TP2 x PP2 x DP2, 8 CPU workers")
        for col in ("iteration", "samples/s", "generation", "phase"):
            t.add_column(col)
        r = self.last
        t.add_row(str(r.get("iteration", "-")), f"{r.get('tput', 0):.1f}", str(r.get("generation", "-")),
                  r.get("phase", "-"))
        h = Table(title="devices")
        for d in sorted(self.health):
            h.add_column(f"dev {d}")
        h.add_row(*[("[red]" if v != "ok" else "[green]") + v for _, v in sorted(self.health.items())])
        from rich.console import Group
        from rich.text import Text

        return Group(t, h, *(Text(line) for line in self.lines[-6:]))

    def iteration(self, rec) -> None:
        self.last = dict(iteration=rec.iteration, tput=rec.samples / max(rec.seconds, 1e-9),
                         generation=rec.generation, phase=rec.phase)
        if self.live is not None:
            self.live.update(self._render())
        else:
            print(f"iteration {rec.iteration:>3}  loss {rec.loss:.4f}  {rec.seconds:.2f}s  "
                  f"gen {rec.generation}  {rec.phase}", flush=True)

    def event(self, ev: JobEvent) -> None:
        from resihp_core.runtime.controller.console import one_line

        line = one_line(f"[iteration {ev.iteration}] {ev.kind}: {ev.text}", 160)
        self.lines.append(line)
        if self.live is not None:
            self.live.update(self._render())
        else:
            print(line, flush=True)


def configure_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job configuration (TOML or YAML; RESIHP_<SECTION>__<FIELD> overrides)")
    p.add_argument("--faults", help="fault scenario (JSON list of {device, iteration, kind, severity|factor|delay_s})")
    p.add_argument("--report", default="reports", help="parent folder of the report")
    p.add_argument("--workdir", help="the job's working folder (worker logs, checkpoints by default); "
                                     "default: a fresh temporary folder")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint of the job's checkpoint folder "
                        "(--workdir of the interrupted run, or training.checkpoint_dir)")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    p.add_argument("--agents", choices=["local", "external"], default="local",
                   help="local: start one agent process per node here (default); external: wait for "
                        "'resihp agent' on each host")
    p.add_argument("--listen", help="controller address for external agents (default: runtime.controller_host"
                                    ":runtime.controller_port)")
    p.add_argument("--agent-timeout", type=float, default=300.0,
                   help="seconds to wait for external agents to connect (default 300)")
    p.add_argument("--interface", help="interface name or address every node's workers bind their collectives "
                                       "to (default: runtime.interface, else the one each agent reaches the "
                                       "controller on)")
