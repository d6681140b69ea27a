"""What the runtime knows of a job beyond its assembly: the report's phases and events,
and the checks that a job fits this machine.

:func:`~resihp_core.runtime.controller.assemble.assemble` turns the configuration (and a fault
scenario) into the job, once per run; ``resihp run`` is :mod:`resihp_core.cli.run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resihp_core.protocols.events import Failure, Injected, JobEvent, PlanPosted, StartUp
from resihp_core.runtime.controller.assemble import AssembledJob, assemble

if TYPE_CHECKING:
    from resihp_core.config import Config
    from resihp_core.faults import Fault
    from resihp_core.runtime.controller.resilient import ResilientRun

__all__ = ["AssembledJob", "Phases", "assemble", "build_job", "check_backend_here", "check_fits_here", "phases",
           "report_events"]

build_job = assemble  # its former name


class Phases:
    """Phase names for the report: healthy, then one phase per fault, marked once
    adapted. A fault is an injected one (known in advance) or a detected one: a failure
    the Detector reported that no injected fault explains (a partition, a process
    killed from outside), or devices rejoining that no injected repair explains. Feed
    the supervisor's events to :meth:`event`; call the object as ``phase_of(iteration,
    generation)``."""

    def __init__(self, faults: list) -> None:
        self._marks: list[tuple[int, int, str]] = []  # (first iteration, order, label)
        self._unexplained = list(faults)
        for f in faults:
            what = f"{f.kind} x{f.factor:.2f}" if f.kind == "slow" else f.kind
            self._add(f.iteration, f"{what} on device {f.device}")
        self._first_gen: dict[int, int] = {}

    def _add(self, iteration: int, label: str) -> None:
        self._marks.append((iteration, len(self._marks), label))
        self._marks.sort()

    def _explained(self, ev: JobEvent, kinds: tuple[str, ...]) -> bool:
        for f in self._unexplained:
            if f.kind in kinds and f.device in ev.devices and f.iteration <= ev.iteration:
                self._unexplained.remove(f)
                return True
        return False

    def event(self, ev: JobEvent) -> None:
        """A job event: a failure or rejoin no injected fault explains starts a phase."""
        devices = sorted(ev.devices)
        if isinstance(ev, Failure):
            if not self._explained(ev, ("kill", "stop", "slow", "comm", "contend")):
                self._add(ev.iteration, f"detected {ev.failure} of devices {devices}")
        elif isinstance(ev, PlanPosted) and ev.kind_of_plan == "rejoin":
            if not self._explained(ev, ("repair",)):
                self._add(ev.iteration, f"rejoin of devices {devices}")

    def __call__(self, i: int, g: int) -> str:
        k = sum(1 for it, _, _ in self._marks if it <= i)
        if k == 0:
            return "1 healthy"
        self._first_gen.setdefault(k, g)
        return f"{k + 1} after {self._marks[k - 1][2]}" + (", adapted" if g > self._first_gen[k] else "")


def report_events(run: ResilientRun, faults: list[Fault]) -> list[JobEvent]:
    """What a run's report marks: the job's events, each injected fault, and the
    start-up (process start and the first iteration, left out of the trace)."""
    startup = run.records[0].seconds if run.records else 0.0
    return [*run.job_events,
            *(Injected(text=f"{f.kind} on device {f.device}" + (f" x{f.factor:.2f}" if f.kind == "slow" else ""),
                       iteration=f.iteration, devices=(f.device,)) for f in faults),
            StartUp(text=f"start-up and first iteration {startup:.1f} s")]


def phases(faults: list) -> Phases:
    """See :class:`Phases`."""
    return Phases(faults)


def check_fits_here(cfg: Config, agents: str = "local") -> None:
    """Refuse up front (naming the field) a job whose workers on this machine together
    need more memory than it has (agents started here run every node's workers here)."""
    from resihp_core.config import ConfigError, memory_estimate

    if agents != "local":
        return
    import psutil

    here = cfg.runtime.nodes * cfg.runtime.devices_per_node
    need = memory_estimate(cfg)["total"] * here
    have = psutil.virtual_memory().total
    if need > have:
        raise ConfigError(
            f"the {here} workers of this machine need about {need / 2**30:.3g} GiB together, but it has "
            f"{have / 2**30:.3g} GiB: make the model smaller or run the nodes' agents on other hosts",
            path="model.hidden", value=cfg.model.hidden)


def check_backend_here(cfg: Config, agents: str = "local") -> None:
    """Refuse up front (naming the field) ``runtime.backend = "nccl"`` when this machine,
    where local agents start every worker, cannot give each worker its own GPU; with
    remote agents each worker checks its own host (docs/gpu.md)."""
    from resihp_core.config import ConfigError

    if agents != "local" or cfg.runtime.backend != "nccl":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"NCCL needs CUDA, but this machine's torch {torch.__version__} sees no CUDA device "
                          "(every worker runs here); use 'auto' or 'gloo'", path="runtime.backend", value="nccl")
    per_node, gpus = cfg.runtime.devices_per_node, torch.cuda.device_count()
    if per_node > gpus:
        raise ConfigError(f"NCCL needs one GPU per worker, but {per_node} workers per node share {gpus} GPU(s) "
                          "here; use 'auto' (shares them over gloo)", path="runtime.backend", value="nccl")
