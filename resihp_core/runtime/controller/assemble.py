"""One way to assemble a job from its configuration: :func:`assemble`, used by
``resihp run``, ``resihp launch`` (FSDP2 / torch_native and DeepSpeed) and the benchmarks.

It turns a :class:`~resihp_core.config.Config` (and a fault scenario) into the first
plan, the topology, the workers' :class:`~resihp_core.job.JobSpec`, the Scheduler's
state and planner. The adapter named by ``runtime.adapter`` builds its own job section
(its registered ``job_config`` function, else the ``[adapter]`` table as it is) and, if
it registered a ``reference``, the fault-free losses a run is checked against. The
result carries the run's :class:`~resihp_core.runtime.controller.runconfig.ResilientConfig` too
(the detector, iterations, repairs, interface, controller grace and observers of ``cfg``).

What a launcher takes from elsewhere than the configuration (a DeepSpeed JSON's op
timeout, a user script that reads its own data, the conformance kit's feature-matrix
section and base layout) comes in as :class:`JobInputs`.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

from resihp_core.job import JobSpec
from resihp_core.plan import ParallelPlan, Topology
from resihp_core.predictor.corpus import Workload
from resihp_core.predictor.predict import ModelShape
from resihp_core.runtime.controller.payback import PaybackRule
from resihp_core.runtime.controller.runconfig import AgentSetup, ResilientConfig
from resihp_core.scheduler.planner import Planner
from resihp_core.scheduler.state import PlannerState

if TYPE_CHECKING:
    from resihp_core.adapter import Capabilities
    from resihp_core.config import Config
    from resihp_core.faults import Fault

__all__ = ["AssembledJob", "JobInputs", "UserData", "assemble", "assemble_spec"]


@dataclass(frozen=True)
class UserData:
    """Data (and a model) the user's script reads itself, as a DeepSpeed script under
    ``resihp launch`` does: the workers are told ``{"source": "user"}`` and no source is
    built from ``[data]``. ResiHP cannot see them, so the first plans are made for
    ``workload`` and ``shape``, stand-ins of the job's batch layout, until the Detector has
    fitted the job's own costs; of ``[model]`` only ``layers`` counts (plans check no
    head count)."""

    workload: Workload
    shape: ModelShape


@dataclass(frozen=True)
class JobInputs:
    """What :func:`assemble` takes from the launcher rather than the configuration.

    :param op_timeout_s: how long a worker's collective or store operation may block
        (``JobSpec.timeout_s``).
    :param user_data: the user's own data (None: the ``[data]`` source).
    :param layer_ranges: the first plan's stage split (None: the even one), e.g. the
        split a DeepSpeed script's ``partition_method`` makes.
    :param section: the adapter's job section as it is, instead of the one its
        ``job_config`` builds from the configuration (the conformance kit runs an adapter
        on the feature matrix it declares: its own section).
    :param data: the workers' data section as it is, instead of the resolved ``[data]``
        source (the kit: an adapter's own; the first plans are made for its workload).
    :param plan: the first plan as it is (it must use the configuration's devices),
        instead of the uniform one of ``[parallel]`` (the kit's base layout).
    """

    op_timeout_s: float = 10.0
    user_data: UserData | None = None
    layer_ranges: tuple[tuple[int, int], ...] | None = None
    section: Mapping[str, object] | None = None
    data: Mapping[str, object] | None = None
    plan: ParallelPlan | None = None


class _Adapter(NamedTuple):
    """What :func:`assemble` needs of an adapter: its name (as workers look it up),
    capabilities and its registered ``job_config`` / ``reference`` functions."""

    name: str
    capabilities: Capabilities
    job_config: Callable[[Config], dict] | None
    reference: Callable[[JobSpec, int], list[float]] | None


def _adapter(cfg: Config) -> _Adapter:
    """The adapter ``runtime.adapter`` names: a registered name, or a ``module:Class``
    target of the user's own (which workers import the same way; it has no
    ``job_config``: its section is ``[adapter]`` as it is)."""
    import importlib

    from resihp_core.config import ConfigError
    from resihp_core.plugins import get_plugins

    name = cfg.runtime.adapter
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls: object = importlib.import_module(module)
            for part in attr.split("."):
                cls = getattr(cls, part)
            caps = getattr(cls, "capabilities")
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot load the adapter class ({e})", path="runtime.adapter", value=name) from None
        return _Adapter(name, caps, None, None)
    registry = get_plugins().adapters()
    try:
        spec = registry.get(name or registry.default_name())
    except LookupError as e:
        raise ConfigError(str(e), path="runtime.adapter", value=name) from None
    return _Adapter(spec.name, spec.capabilities, spec.function("job_config"), spec.function("reference"))


class AssembledJob(NamedTuple):
    """A job ready to run: ``run`` is what :func:`~resihp_core.runtime.controller.resilient.run_resilient`
    takes (its job parts are the fields before it; callers add their hooks, agents and
    resume point with :func:`dataclasses.replace`)."""

    plan: ParallelPlan  # the first plan
    topology: Topology
    spec: JobSpec  # the workers' job description
    state: PlannerState  # the Scheduler's state of the first plan
    planner: Planner
    reference: Callable[[JobSpec, int], list[float]] | None  # fault-free losses, if the adapter has them
    run: ResilientConfig


def assemble(cfg: Config, faults: Sequence[Fault] = (), workdir: Path | None = None,
             inputs: JobInputs = JobInputs()) -> AssembledJob:
    """Assemble the job of ``cfg`` for the adapter named by ``runtime.adapter``
    (checkpoints default to ``<workdir>/checkpoints``; every check of the configuration
    against the adapter happens here, before anything starts)."""
    from resihp_core.config import ConfigError
    from resihp_core.faults import repairs, worker_faults
    from resihp_core.job import JobSpec
    from resihp_core.plan import ScheduleKind
    from resihp_core.plugins import get_plugins
    from resihp_core.data import create_source
    from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
    from resihp_core.predictor.predict import IterationPredictor, workload_features

    par, mod, tr = cfg.parallel, cfg.model, cfg.training
    adapter = _adapter(cfg)
    make_section = adapter.job_config
    try:
        section = (dict(inputs.section) if inputs.section is not None else
                   make_section(cfg) if make_section is not None else dict(cfg.adapter))
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), path="adapter") from None
    user = inputs.user_data
    plan = inputs.plan or ParallelPlan.uniform(tp=par.tp, pp=par.pp, dp=par.dp, num_layers=mod.layers,
                                               num_microbatches=tr.microbatches,
                                               num_heads=mod.heads if user is None else 0,
                                               schedule=ScheduleKind(cfg.scheduler.schedule))
    if inputs.layer_ranges is not None:
        plan = plan.with_(layer_ranges=tuple(inputs.layer_ranges))
    topology = Topology.uniform(cfg.runtime.nodes, cfg.runtime.devices_per_node,
                                cfg.scheduler.device_memory_gib)
    plan.validate(topology)
    caps = adapter.capabilities
    why = caps.violations(plan)
    if why:
        raise ConfigError(f"adapter {adapter.name!r} cannot run this plan: {'; '.join(why)}",
                          path="runtime.adapter", value=adapter.name)
    n = tr.token_budget
    if user is None:
        # The job's data source ([data]; default: the synthetic long-tailed corpus), built
        # here first: a bad section fails before any worker starts, and workers rebuild the
        # very same source from its resolved spec (paths made absolute, corpus fingerprint).
        given = dict(inputs.data) if inputs.data is not None else None
        source = create_source(given if given is not None else cfg.data.section(), dp=par.dp,
                               num_microbatches=tr.microbatches, seed=tr.seed, token_budget=n, vocab_size=mod.vocab)
        data, workload = (given if given is not None else source.spec()), source.workload(0)
        shape = ModelShape(tokens=n, hidden=mod.hidden, dtype_bytes=4,
                           params_per_layer=4 * mod.hidden * mod.hidden + 3 * mod.hidden * mod.ffn)
    else:
        data, workload, shape = {"source": "user"}, user.workload, user.shape
    spec = JobSpec(
        adapter=adapter.name, adapter_config=section, data=data,
        dp=par.dp, num_microbatches=tr.microbatches, seed=tr.seed, timeout_s=inputs.op_timeout_s,
        checkpoint_dir=tr.checkpoint_dir or str(Path(workdir or tempfile.gettempdir()) / "checkpoints"),
        checkpoint_every=tr.checkpoint_every, checkpoint_keep=tr.checkpoint_keep,
        memory_copy_every=tr.memory_copy_every,
        faults=worker_faults(faults),
    )
    # A prior for the first plans only: equal per-layer cost and CPU-like links. Once
    # the Detector has fitted the job's own cost model from its warm-up profiles, the
    # supervisor plans with that one (ControlLoop.fitted).
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8,
                                       ref_layers=max(1, mod.layers // par.pp), ref_tp=1), par.pp)
    links = LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9, intra_latency=5e-5, inter_latency=1e-4)
    predictor = IterationPredictor(cost, topology, shape, links)
    feats = workload_features(workload, par.dp, tr.microbatches)
    state = PlannerState.create(topology, plan, predictor, feats, capabilities=caps,
                                k_min=cfg.scheduler.k_min, delta=cfg.scheduler.delta)
    planner = Planner(capabilities=caps)
    work = Path(workdir or tempfile.gettempdir())
    run = ResilientConfig(spec=spec, plan=plan, topology=topology, state=state, planner=planner, detector=cfg.detector,
                          iterations=tr.iterations, workdir=work / "job", repairs=repairs(faults),
                          agents=AgentSetup(interface=cfg.runtime.interface),
                          controller_grace_s=cfg.runtime.controller_grace_s, state_dir=work, config=cfg,
                          observers=get_plugins(),
                          payback=PaybackRule(horizon_iterations=cfg.scheduler.payback_horizon_iterations,
                                              default_cost_s=cfg.scheduler.payback_default_cost_s))
    return AssembledJob(plan, topology, spec, state, planner, adapter.reference, run)


def assemble_spec(job: JobSpec, plan: ParallelPlan, *, iterations: int, faults: Sequence[Fault] = (),
                  workdir: Path | None = None, detector: Mapping[str, object] | None = None) -> AssembledJob:
    """:func:`assemble` for a job written as the workers' :class:`~resihp_core.job.JobSpec`
    and its first plan (the conformance kit, benchmarks): the configuration is made of
    ``plan``'s shape (one node of its devices), the job's seed and checkpoint settings and
    ``detector``, with no controller grace; the adapter's section and data go to the
    workers as they are (:class:`JobInputs`), ``faults`` are added to the job's own."""
    from dataclasses import replace

    from resihp_core.config import Config

    if (job.dp, job.num_microbatches) != (plan.dp, plan.num_microbatches):
        from resihp_core.config import ConfigError

        raise ConfigError(f"the job's batch (dp {job.dp} x {job.num_microbatches} micro-batches) is not the first "
                          f"plan's ({plan.dp} x {plan.num_microbatches})", path="parallel.dp", value=plan.dp)
    world = len(plan.devices())
    tp = max(1, world // (plan.pp * plan.dp))
    data = dict(job.data)
    budget = data.get("token_budget", 128)
    cfg = Config.from_dict({
        "parallel": {"tp": tp, "pp": plan.pp, "dp": plan.dp},
        "model": {"layers": plan.num_layers, "heads": plan.num_heads or max(4, tp)},
        "training": {"microbatches": plan.num_microbatches, "iterations": iterations, "seed": job.seed,
                     "token_budget": budget if isinstance(budget, int) else 128,
                     "checkpoint_dir": job.checkpoint_dir or "", "checkpoint_every": job.checkpoint_every,
                     "checkpoint_keep": job.checkpoint_keep, "memory_copy_every": job.memory_copy_every},
        "runtime": {"adapter": job.adapter, "nodes": 1, "devices_per_node": world, "controller_grace_s": 0.0},
        "scheduler": {"schedule": plan.schedule.value},
        "detector": dict(detector or {}),
    }, source=f"job of {job.adapter}")
    out = assemble(cfg, faults, workdir, JobInputs(op_timeout_s=job.timeout_s, section=job.adapter_config,
                                                   data=data, plan=plan))
    spec = replace(out.spec, faults=[*job.faults, *out.spec.faults], dump_dir=job.dump_dir)
    return out._replace(spec=spec, run=replace(out.run, spec=spec))
