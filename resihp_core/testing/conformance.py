"""The adapter conformance kit: run any adapter through the lifecycle the worker drives,
and through every capability it declares, against its own fault-free run.

An adapter author calls :func:`check_adapter` (or the pytest fixture in
:mod:`resihp_core.testing.plugin`) with a job description naming the adapter and a base
layout. Every run is the job :func:`~resihp_core.runtime.controller.assemble.assemble_spec` makes of
them (``assemble()``, as for ``resihp run``: the adapter's own section and data, the base
layout as the first plan) and starts real worker processes
(``resihp_core.runtime.worker``). A scenario that kills a device (``replica_drop``,
``restore``) runs that job as ``resihp run`` does, through
:func:`~resihp_core.runtime.controller.resilient.run_resilient` (controller, node agent, the
supervisor's control loop); the others post their plans through
:class:`~resihp_core.runtime.controller.launcher.LocalJob`. Each trains a few iterations,
changes the plan the way the capability promises (with a SIGKILLed peer where that is
the point), finishes, and compares:

- the complete training state by the framework's own account
  (:meth:`~resihp_core.adapter.Adapter.full_state` of every device: parameters including
  tied ones, optimizer state including step counts, LR scheduler, RNG, data position)
  with the fault-free run of the same adapter, to ``tol`` relative error, when the
  adapter provides it (``progress`` says when it does not);
- every parameter and its optimizer tensors, assembled from the
  :class:`~resihp_core.adapter.Shard` pieces the workers dump (``held_state``);
- the loss of every iteration with the fault-free run's;
- the micro-batch accounting: every (stage, owner, micro-batch) exactly once per
  iteration.

Scenarios (``docs/adapters.md``): ``regeneration`` (a new generation of the same plan
mid-iteration: rollback and an identity move; every adapter), ``killed_peer`` (a peer
SIGKILLed mid-iteration; the survivors go on with a plan the adapter declares it can
run, or restore), and one per declared capability: ``tp_resize``, ``layer_repartition``,
``migration``, ``replica_drop``, ``slow_drop`` (the replica dropped alive, as a fail-slow
re-plan drops it: state only it holds moves from it), ``restore``. A capability declared
but failed is a :class:`ConformanceError`; a capability not declared is not run.

A scenario with a killed device runs on the production path: the victims die by
the workers' own fault injector (as a job's ``[[faults]]``), the controller reports
them, the supervisor aborts, asks its planner (the kit's one scripted answer: the
scenario's plan) and deploys; for ``restore`` it selects the checkpoint by its own rule
(:func:`resihp_core.checkpoints.restore_point`) and resumes after it. An adapter whose
checkpoints the supervisor cannot find or verify (not in the core's layout,
``docs/checkpoints.md``) fails it: the job would silently start over from the initial
state.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from resihp_core.adapter import Capabilities, Shard
from resihp_core.faults import Fault
from resihp_core.job import JobSpec
from resihp_core.plan import Migration, ParallelPlan, ranges_from_counts
from resihp_core.protocol import FailureReport
from resihp_core.scheduler.planner import PlanDecision, Planner
from resihp_core.scheduler.state import PlannerState

if TYPE_CHECKING:
    from resihp_core.runtime.controller.assemble import AssembledJob
    from resihp_core.runtime.controller.launcher import LocalJob

__all__ = ["ConformanceError", "Outcome", "Scenario", "check_adapter", "scenarios", "run_scenario",
           "capabilities_of"]


class ConformanceError(AssertionError):
    """An adapter did not do what it declares; the message names scenario and tensor."""


@dataclass(frozen=True)
class Scenario:
    """Train ``switch_at`` iterations on the base plan, optionally SIGKILL ``kill``,
    switch to ``change(base)`` (restoring the last checkpoint if ``restore``), finish."""

    name: str
    change: Callable[[ParallelPlan], ParallelPlan]
    kill: Callable[[ParallelPlan], list[int]] = lambda p: []
    restore: bool = False


@dataclass
class Outcome:
    """What a run left: assembled full state, losses and accounting per iteration."""

    state: dict[str, list[Any]]
    losses: list[float]
    computed: list[Counter] = field(default_factory=list)
    full: dict[str, Any] | None = None  # the framework's complete state (None: not provided)


def capabilities_of(adapter: str) -> Capabilities:
    """Declared capabilities of a registered adapter name or a ``module:Class`` target."""
    if ":" in adapter:
        module, _, cls = adapter.partition(":")
        return getattr(importlib.import_module(module), cls).capabilities
    from resihp_core.plugins import Plugins

    return Plugins().adapters().get(adapter).capabilities


# ------------------------------------------------------------------ scenarios
def _drop_replica(p: ParallelPlan, r: int) -> ParallelPlan:
    groups = tuple(((),) * p.pp if rr == r else rep for rr, rep in enumerate(p.tp_groups))
    moves = tuple(Migration(s, r, j, 0 if r else 1) for s in range(p.pp) for j in range(p.num_microbatches))
    return p.with_(tp_groups=groups, migrations=moves, excluded=frozenset(p.devices()) - frozenset(
        d for rep in groups for g in rep for d in g))


def _shrink_tp(p: ParallelPlan, everywhere: bool) -> ParallelPlan:
    groups = [list(rep) for rep in p.tp_groups]
    spare = []
    for r, rep in enumerate(groups):
        for s, g in enumerate(rep):
            if everywhere or (r, s) == (0, 0):
                rep[s] = g[: len(g) // 2]
                spare += g[len(g) // 2:]
    return p.with_(tp_groups=tuple(tuple(r) for r in groups), standbys=tuple(spare))


def _fewer_replicas(p: ParallelPlan, lost: list[int]) -> ParallelPlan:
    """The base layout on the replicas that lost no device, same global batch."""
    keep = [r for r in range(p.dp) if not set(lost) & {d for g in p.tp_groups[r] for d in g}]
    total = p.dp * p.num_microbatches
    if not keep or total % len(keep):
        raise ConformanceError(f"restore scenario needs the global batch {total} to split over {len(keep)} replicas")
    return p.with_(tp_groups=tuple(p.tp_groups[r] for r in keep), num_microbatches=total // len(keep),
                   migrations=(), excluded=frozenset(lost))


def scenarios(caps: Capabilities, base: ParallelPlan) -> list[Scenario]:
    """The scenarios ``caps`` promises on ``base`` (killed peers included)."""
    last = lambda p: [p.devices()[-1]]  # noqa: E731 - a device of the last replica
    out = [Scenario("regeneration", lambda p: p)]
    if caps.tp_resize and max(base.degree(r, s) for r, s in base.executors()) > 1:
        out.append(Scenario("tp_resize", lambda p: _shrink_tp(p, everywhere=not caps.heterogeneous_tp)))
    if caps.layer_repartition and base.pp > 1:
        counts = [b - a for a, b in base.layer_ranges]
        i = max(range(base.pp), key=lambda s: counts[s])
        j = (i + 1) % base.pp
        counts[i], counts[j] = counts[i] - 1, counts[j] + 1
        out.append(Scenario("layer_repartition", lambda p, c=tuple(counts): p.with_(layer_ranges=ranges_from_counts(list(c)))))
    if caps.uneven_dp and base.dp > 1:  # both migrate whole micro-batches (uneven_dp suffices)
        m = base.num_microbatches
        out.append(Scenario("migration", lambda p: p.with_(migrations=tuple(
            Migration(s, 1, j, 0) for s in range(p.pp) for j in range(m - 1, m)))))
        out.append(Scenario("replica_drop", lambda p: _drop_replica(p, p.dp - 1),
                            kill=lambda p: [d for g in p.tp_groups[-1] for d in g]))
        # What a fail-slow re-plan does: the slow replica's devices stay alive, stand by,
        # and still hold state the new plan needs (a sharded stage's other half)
        out.append(Scenario("slow_drop", lambda p: _drop_replica(p, p.dp - 1).with_(excluded=frozenset())))
    if caps.checkpoint and base.dp > 1:
        out.append(Scenario("restore", lambda p: _fewer_replicas(p, last(p)), kill=last, restore=True))
    if not (caps.uneven_dp or caps.checkpoint):
        raise ConformanceError("the adapter declares no way to survive a killed peer "
                               "(neither cross_replica_migration / uneven_dp nor checkpoint)")
    return out


# ------------------------------------------------------------------ running
def _assemble(dumps: dict[int, dict]) -> dict[str, list[Any]]:
    """Full tensors from every worker's shards; replicas of one piece must agree."""
    import torch

    pieces: dict[str, dict[int, tuple]] = {}
    meta: dict[str, tuple] = {}
    for dev, d in sorted(dumps.items()):
        for name, sh in d["state"].items():
            have = pieces.setdefault(name, {})
            meta.setdefault(name, (sh.dim, sh.parts))
            if (sh.dim, sh.parts) != meta[name]:
                meta[name] = (sh.dim, 0)  # mixed layouts: assemble each device's share
            if sh.index in have and not all(torch.equal(a, b) for a, b in zip(have[sh.index], sh.tensors)):
                raise ConformanceError(f"{name}: piece {sh.index} differs between replicas (device {dev})")
            have.setdefault(sh.index, sh.tensors)
    out = {}
    for name, have in pieces.items():
        dim, parts = meta[name]
        if dim is None:
            out[name] = list(have[0])
        else:
            if sorted(have) != list(range(parts)):
                raise ConformanceError(f"{name}: pieces {sorted(have)} of {parts} held")
            out[name] = [torch.cat([have[i][k] for i in range(parts)], dim) for k in range(len(have[0]))]
    return out


def _assemble_full(dumps: dict[int, dict]) -> dict[str, Any] | None:
    """The job's complete state from every device's ``full_state()``: tensors and plain
    values must agree wherever several devices report a name (replicas); :class:`Shard`
    pieces are put together as in :func:`_assemble`. None if the adapter gives none."""
    import torch

    fulls = {dev: d.get("full") for dev, d in dumps.items()}
    if any(f is None for f in fulls.values()):
        return None
    plain: dict[str, Any] = {}
    pieces: dict[int, dict] = {}
    for dev, full in sorted(fulls.items()):
        shards = {}
        for name, v in full.items():
            if isinstance(v, Shard):
                shards[name] = v
                continue
            if name not in plain:
                plain[name] = v
                continue
            have = plain[name]
            same = (torch.equal(have, v) if isinstance(v, torch.Tensor) and isinstance(have, torch.Tensor)
                    and have.shape == v.shape else have == v)
            if not same:
                raise ConformanceError(f"complete state: {name} differs between devices (device {dev})")
        pieces[dev] = {"state": shards}
    out = dict(plain)
    for name, ts in _assemble(pieces).items():
        if name in out:
            raise ConformanceError(f"complete state: {name} is reported both whole and as pieces")
        out[name] = ts[0]
    return out


#: The kit's detector waits this long before calling a stall a hang and sees no fail-slow:
#: it proves state, not detection, on a loaded machine.
_DETECTOR = {"heartbeat_miss_limit": 50, "slow_threshold": 1e6}


def _kit_job(job: JobSpec, base: ParallelPlan, *, iterations: int, faults: list[Fault], timeout: float,
             work: str) -> AssembledJob:
    """The kit's job, assembled as ``resihp run`` assembles a user's
    (:func:`~resihp_core.runtime.controller.assemble.assemble_spec`: the adapter's own section and
    data, the base layout as the first plan), ``faults`` injected by the workers as a
    job's ``[[faults]]``."""
    from pathlib import Path

    from resihp_core.config import ConfigError
    from resihp_core.runtime.controller.assemble import assemble_spec

    try:
        return assemble_spec(job, base, iterations=iterations, faults=faults, workdir=Path(work),
                             detector={**_DETECTOR, "hang_min_timeout_s": timeout})
    except ConfigError as e:
        raise ConformanceError(f"the kit cannot assemble a job of {job.adapter} on the base plan: {e}") from None


class _ScenarioPlanner(Planner):
    """A scenario's planner: whatever fails, its answer is the scenario's plan (as a
    restore for ``restore``, else a "continue"). Everything else, noticing the dead
    worker, aborting, choosing the checkpoint and the resume point, posting, is the
    supervisor's own (:class:`~resihp_core.runtime.controller.control.ControlLoop`). The Scheduler's
    state keeps the base layout: the scenario's plan may have fewer replicas than a home
    layout allows, and nothing in the kit plans from it again."""

    def __init__(self, target: ParallelPlan, scenario: Scenario, victims: list[int]) -> None:
        super().__init__(stages=())
        self.target, self.scenario, self.victims = target, scenario, set(victims)

    def plan(self, state: PlannerState, report: FailureReport | None = None) -> PlanDecision:
        devices = set(report.devices if report is not None else ())
        if not devices <= self.victims:
            raise ConformanceError(f"{self.scenario.name}: a failure of devices {sorted(devices - self.victims)} "
                                   f"that the kit did not inject ({report.failure if report else '-'}: "
                                   f"{getattr(report, 'evidence', '')!s:.120})")
        return PlanDecision(plan=self.target, kind="restore" if self.scenario.restore else "continue",
                            reason=f"conformance kit: {self.scenario.name}", predicted_time=0.0, timings={},
                            state=state.with_health(failed=frozenset(state.failed | devices)))

    def rejoin(self, state: PlannerState, devices: Iterable[int]) -> PlanDecision:
        raise ConformanceError(f"{self.scenario.name}: devices {sorted(devices)} offered back; the kit repairs none")


def _supervised(asm: AssembledJob, base: ParallelPlan, scenario: Scenario, ckpt: str, *, env: dict[str, str] | None,
                timeout: float) -> LocalJob:
    """A scenario with a fault on the production path: :func:`~resihp_core.runtime.controller.resilient.run_resilient`
    runs the assembled job (controller, a node agent, the supervisor's control loop), the
    victims die by the workers' own fault injector, and the supervisor deploys the
    scenario's plan. For ``restore`` it restores the checkpoint *its* rule selects
    (:func:`resihp_core.checkpoints.restore_point`) and resumes after it: an adapter
    whose checkpoints it cannot select (the job would silently start over) fails, and so
    does one that re-trains iterations before the restored one. Returns the finished
    job (its reports stay readable)."""
    from resihp_core.runtime.controller.resilient import run_resilient
    from resihp_core.runtime.controller.runconfig import RunHooks

    victims = scenario.kill(base)
    failed: list[ConformanceError] = []
    jobs: list[LocalJob] = []

    from resihp_core.protocols.events import Event, PlanPosted

    deployed: list[PlanPosted] = []

    def watch(ev: Event) -> None:
        if not isinstance(ev, PlanPosted) or ev.kind_of_plan not in ("restore", "continue"):
            return
        deployed.append(ev)
        if not scenario.restore:
            return
        if ev.restore is None:  # the job would re-train from the seed: stop it here
            from resihp_core import checkpoints

            found = sorted(os.listdir(ckpt))[:8]
            why = "; ".join(f"iteration {c.iteration}: {c.problem}" for c in checkpoints.scan(ckpt) if c.problem)
            failed.append(ConformanceError(
                f"{scenario.name}: the supervisor finds no complete checkpoint in {ckpt} (it holds "
                f"{found or 'nothing'}{'; ' + why if why else ''}) and would restart the job from the initial "
                "state: an adapter writes its files inside iter<NNNNNNNN>/ and seals them with a manifest "
                "(resihp_core.checkpoints.seal; docs/checkpoints.md)"))
            raise failed[-1]
        if ev.resume != ev.restore + 1:
            failed.append(ConformanceError(f"{scenario.name}: restored the checkpoint of iteration {ev.restore} "
                                           f"but resumed at iteration {ev.resume}"))
            raise failed[-1]

    run = dataclasses.replace(
        asm.run, planner=_ScenarioPlanner(scenario.change(base), scenario, victims), timeout_s=timeout * 3,
        worker_env=dict(env or {}), move_before_restore=False,
        hooks=RunHooks(observe=watch, before_run=lambda job, agents: jobs.append(job)))
    out = run_resilient(run)
    if failed:
        raise failed[0]
    if not out.ok:
        raise ConformanceError(f"{scenario.name}: the job failed after devices {victims} were killed: {out.error} "
                               f"(logs: {out.logs})")
    if not deployed:
        raise ConformanceError(f"{scenario.name}: the supervisor never deployed the scenario's plan after devices "
                               f"{victims} were killed (events: {[ev.get('text', '')[:80] for ev in out.events]})")
    return jobs[0]


def run_scenario(job: JobSpec, base: ParallelPlan, scenario: Scenario | None, *, iterations: int = 4,
                 switch_at: int = 2, env: dict[str, str] | None = None, timeout: float = 120.0) -> Outcome:
    """Run one scenario (None: the fault-free run) with real workers; return its outcome.
    The job is the one :func:`~resihp_core.runtime.controller.assemble.assemble` makes of ``job``
    (:func:`_kit_job`); a scenario that kills a device runs it as ``resihp run`` does
    (:func:`_supervised`), the others post the scenario's plan themselves."""
    import torch

    from resihp_core.runtime.controller.launcher import LocalJob, NoProgress

    dump = tempfile.mkdtemp(prefix="resihp-conformance-")
    ckpt = tempfile.mkdtemp(prefix="resihp-conformance-ckpt-")
    work = tempfile.mkdtemp(prefix="resihp-conformance-job-")
    victims = scenario.kill(base) if scenario is not None else []
    restore = scenario is not None and scenario.restore
    # Killed as they start iteration switch_at: the peers wait for them inside that iteration.
    faults = [Fault(device=d, iteration=switch_at, kind="kill") for d in victims]
    asm = _kit_job(dataclasses.replace(job, dump_dir=dump, checkpoint_dir=ckpt, checkpoint_every=1 if restore else 0),
                   base, iterations=iterations, faults=faults, timeout=timeout, work=work)
    spec = asm.spec
    if victims:
        lj = _supervised(asm, base, scenario, ckpt, env=env, timeout=timeout)  # finished and closed
    else:
        lj = LocalJob(spec.to_json(), base.devices(), env=env)
        with lj:
            lj.post(base, iterations=iterations)
            if scenario is not None:
                lj.wait(switch_at, timeout=timeout)
                resume = lj.abort()
                lj.post(scenario.change(base), iterations=iterations, resume=resume)
            try:
                lj.wait(iterations, timeout=timeout)
            except NoProgress as e:  # it names each device's reason when they all left
                if scenario is None:
                    raise
                raise ConformanceError(f"{scenario.name}: {e}") from e
    losses, computed = [], []
    for i in range(iterations):
        rep = lj.report(i)
        losses.append(sum(r.loss for r in rep.values()))
        computed.append(Counter(tuple(c) for r in rep.values() for c in r.computed))
    dumps = {int(f[len("device"):-3]): torch.load(os.path.join(dump, f), weights_only=False)
             for f in os.listdir(dump)}
    if not dumps:
        raise ConformanceError("no worker dumped its state at the end of the job")
    for dev, d in dumps.items():
        if d["iteration"] != iterations:
            raise ConformanceError(f"device {dev} ended at iteration {d['iteration']}, not {iterations}")
    out = Outcome(_assemble(dumps), losses, computed, _assemble_full(dumps))
    # Passed: its dumps, checkpoints and logs are in `out` or no longer needed (a failed
    # run keeps them: its error names the folder to look in); some megabytes per run.
    for folder in (dump, ckpt, work):
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _close(a: Any, b: Any, tol: float) -> tuple[bool, float]:
    """Whether value ``a`` equals the fault-free ``b`` (tensors and floats to ``tol``
    relative error; anything else exactly), and the relative error."""
    import torch

    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return False, float("inf")
        if not b.is_floating_point():
            return bool(torch.equal(a, b)), 0.0
        if not b.numel():
            return True, 0.0
        err = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
        return err <= tol, err
    if isinstance(b, float) and isinstance(a, (int, float)) and not isinstance(a, bool):
        err = abs(a - b) / max(abs(b), 1e-30)
        return err <= tol, err
    if isinstance(b, (list, tuple)) and isinstance(a, (list, tuple)) and len(a) == len(b):
        res = [_close(x, y, tol) for x, y in zip(a, b)]
        return all(ok for ok, _ in res), max((e for _, e in res), default=0.0)
    return a == b, 0.0


def _compare_full(name: str, got: dict[str, Any], want: dict[str, Any], tol: float) -> float:
    """The complete state of a scenario against the fault-free run's, name by name."""
    if set(got) != set(want):
        raise ConformanceError(f"{name}: complete state: {sorted(set(got) ^ set(want))} missing or extra "
                               "(compared with the fault-free run)")
    worst = 0.0
    for key in sorted(want):
        ok, err = _close(got[key], want[key], tol)
        if not ok:
            show = (lambda v: f"{v!r}"[:80]) if not hasattr(want[key], "shape") else (lambda v: "tensor")
            raise ConformanceError(f"{name}: complete state: {key} differs from the fault-free run "
                                   f"({show(got[key])} vs {show(want[key])}, relative error {err:.3g} > {tol:g})")
        worst = max(worst, err)
    return worst


def _compare(name: str, got: Outcome, want: Outcome, base: ParallelPlan, job: JobSpec, tol: float) -> float:
    worst = 0.0
    if got.full is not None and want.full is not None:
        worst = _compare_full(name, got.full, want.full, tol)
    if set(got.state) != set(want.state):
        raise ConformanceError(f"{name}: parameters {sorted(set(got.state) ^ set(want.state))} missing or extra")
    for pname, ts in want.state.items():
        for k, (a, b) in enumerate(zip(got.state[pname], ts)):
            if a.shape != b.shape:
                raise ConformanceError(f"{name}: {pname}[{k}] has shape {tuple(a.shape)}, fault-free {tuple(b.shape)}")
            err = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)) if b.numel() else 0.0
            worst = max(worst, err)
            if err > tol:
                raise ConformanceError(f"{name}: {pname} (tensor {k}) differs from the fault-free run "
                                       f"by {err:.3g} relative (> {tol:g})")
    for i, (a, b) in enumerate(zip(got.losses, want.losses)):
        if abs(a - b) > tol * max(abs(b), 1e-30):
            raise ConformanceError(f"{name}: iteration {i} loss {a!r} != fault-free {b!r}")
    want_per_stage = job.dp * job.num_microbatches  # a restore may re-split the global batch
    for i, c in enumerate(got.computed):
        per_stage = Counter(s for (s, _, _) in c.elements())
        if any(n != 1 for n in c.values()) or any(n != want_per_stage for n in per_stage.values()):
            raise ConformanceError(f"{name}: iteration {i} micro-batch accounting {dict(c)}: want every "
                                   f"(stage, owner, mb) once, {want_per_stage} per stage")
    return worst


def check_adapter(job: JobSpec, base: ParallelPlan, *, only: list[str] | None = None, tol: float = 1e-9,
                  env: dict[str, str] | None = None, iterations: int = 4,
                  progress: Callable[[str], None] = lambda line: None, timeout: float = 120.0,
                  reference: Outcome | None = None, jobs: int = 1) -> dict[str, float]:
    """Run the fault-free job and every scenario ``job.adapter`` declares; returns the
    worst relative error per scenario or raises :class:`ConformanceError`. ``timeout``:
    seconds each wait for iterations may take (worker start-up included). ``reference``:
    the fault-free outcome of this job already run (:func:`run_scenario` with no
    scenario, the same ``iterations``), so tests of one job can share it. ``jobs``: how
    many of these runs (each its own worker processes, store and ports) go at once. A
    run spends much of its time in one process at a time (imports, rendezvous,
    teardown), so on a CPU-only machine 2 finish sooner than one after the other; on
    accelerators keep 1: every run uses every device of ``base``."""
    from concurrent.futures import Future, ThreadPoolExecutor

    if jobs < 1:
        raise ValueError(f"jobs={jobs}: at least one run at a time")
    caps = capabilities_of(job.adapter)
    violations = caps.violations(base)
    if violations:
        raise ConformanceError(f"base plan not runnable by {job.adapter}: {'; '.join(violations)}")
    todo = [s for s in scenarios(caps, base) if only is None or s.name in only]
    for sc in todo:  # refused before any run starts
        new = sc.change(base)
        bad = caps.violations(new, base) if not sc.restore else caps.violations(new)
        if bad:
            raise ConformanceError(f"scenario {sc.name} builds a plan {job.adapter} rules out: {'; '.join(bad)}")

    def run(sc: Scenario | None) -> Outcome:
        progress(f"{job.adapter}: fault-free run ({base.dp}x{base.pp}, TP {base.degree(0, 0)})" if sc is None
                 else f"{job.adapter}: {sc.name}")
        return run_scenario(job, base, sc, iterations=iterations, env=env, timeout=timeout)

    # One at a time: in the listed order. Several: the runs with a killed device first,
    # the longest (the failure is noticed and recovered from), so none is left alone last.
    order = todo if jobs == 1 else sorted(todo, key=lambda sc: not sc.kill(base))
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="resihp-kit") as pool:
        pending: Future[Outcome] | None = None if reference is not None else pool.submit(run, None)
        runs = {sc.name: pool.submit(run, sc) for sc in order}
        try:
            want = reference if pending is None else pending.result()
            if len(want.losses) != iterations:
                raise ConformanceError(f"reference: {len(want.losses)} iterations, the scenarios run {iterations}")
            if want.full is None:
                progress(f"{job.adapter}: does not report full_state(); comparing held_state() only "
                         "(parameters and the optimizer tensors it chooses to report)")
            return {sc.name: _compare(sc.name, runs[sc.name].result(), want, base, job, tol) for sc in todo}
        except BaseException:
            # Runs not started yet never start; those running end by themselves (their
            # own timeouts) and clean up before this raises.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
