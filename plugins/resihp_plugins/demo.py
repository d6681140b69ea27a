"""``resihp demo`` and ``resihp run CONFIG``: a resilient job on this machine, end to end.

``resihp run`` builds the job from a configuration file (``resihp_core.config``) and an
optional fault scenario (``resihp_plugins.faults``); ``resihp demo`` is one fixed
configuration of it (:data:`DEMO_CONFIG`) with two injected faults:

Eight worker processes of the reference backend train a small LLaMA-style model on the
variable-length corpus. Two node agents (four devices each) watch them and feed the
controller; the Scheduler plans every reconfiguration; the supervisor deploys it live.
A compute fail-slow is injected on one device, then a fail-stop (SIGKILL) on another.
A live terminal view shows iteration, throughput, plan generation and per-device
health; the run ends with a summary table and a report folder (JSON events, loss
against a fault-free reference, iteration-time trace with detections and plan
changes, throughput per phase, as PNG plots).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from resihp_core.hookspecs import hookimpl

__all__ = ["DEMO_CONFIG", "build_job", "phases", "run_demo", "run_config", "resihp_register_commands"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=36, help="training iterations (default 36)")
    p.add_argument("--slow-at", type=int, default=8, help="iteration of the compute fail-slow")
    p.add_argument("--kill-at", type=int, default=22, help="iteration of the SIGKILL")
    p.add_argument("--severity", default="strong", choices=["weak", "medium", "strong"])
    p.add_argument("--report", default="reports", help="parent folder of the report")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    p.add_argument("--adapter", choices=["megatron_ref", "deepspeed"], default="megatron_ref",
                   help="megatron_ref: the reference backend, TP2 x PP2 x DP2 (default); deepspeed: "
                        "examples/deepspeed_pipeline under 'resihp launch', PP2 x DP2, with a kill")


DEMO_CONFIG = {
    "parallel": {"tp": 2, "pp": 2, "dp": 2},
    "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "ffn_hidden": 128},
    "training": {"microbatches": 4, "token_budget": 256, "iterations": 36, "lr": 3e-3},
    "runtime": {"nodes": 2, "devices_per_node": 4},
    "detector": {"heartbeat_interval_s": 0.1, "heartbeat_miss_limit": 8, "hang_min_timeout_s": 20.0,
                 "warmup_iterations": 3, "min_changepoint_gap": 3},
}


def build_job(cfg, faults: list, workdir: Path):
    """Plan, topology, worker job description, planner state and planner for a
    :class:`~resihp_core.config.Config` on the reference backend."""
    from resihp_core.plan import ParallelPlan, ScheduleKind, Topology
    from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
    from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
    from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
    from resihp_core.scheduler.planner import Planner
    from resihp_core.scheduler.state import PlannerState
    from resihp_adapters.megatron_ref.plugin import CAPABILITIES
    from resihp_core.job import JobSpec
    from resihp_plugins.faults import worker_faults

    par, mod, tr = cfg.parallel, cfg.model, cfg.training
    plan = ParallelPlan.uniform(tp=par.tp, pp=par.pp, dp=par.dp, num_layers=mod.layers,
                                num_microbatches=tr.microbatches, num_heads=mod.heads,
                                schedule=ScheduleKind(cfg.scheduler.schedule))
    topology = Topology.uniform(cfg.runtime.nodes, cfg.runtime.devices_per_node,
                                cfg.scheduler.device_memory_gib)
    plan.validate(topology)
    n = tr.token_budget
    corpus = dict(scale=max(2.0, n / 10), shape=1.0, min_len=min(4, n), max_len=n, token_budget=n, seed=tr.seed)
    ffn = mod.ffn_hidden or 4 * mod.hidden
    spec = JobSpec(
        adapter=cfg.runtime.adapter,
        adapter_config=dict(vocab_size=mod.vocab, hidden=mod.hidden, num_heads=mod.heads, ffn_hidden=ffn,
                            num_layers=mod.layers, dtype=tr.dtype, seed=tr.seed, lr=tr.lr),
        data=dict(source="synthetic", **corpus), dp=par.dp, num_microbatches=tr.microbatches, seed=tr.seed,
        timeout_s=10.0, checkpoint_dir=tr.checkpoint_dir or str(workdir / "checkpoints"), checkpoint_every=1,
        faults=worker_faults(faults),
    )
    # Planning model: equal per-layer cost and CPU-like links. The planner compares
    # plans relative to each other; the Detector fits its own model from live profiles.
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8,
                                       ref_layers=max(1, mod.layers // par.pp), ref_tp=1), par.pp)
    links = LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9, intra_latency=5e-5, inter_latency=1e-4)
    params = 4 * mod.hidden * mod.hidden + 3 * mod.hidden * ffn
    predictor = IterationPredictor(cost, topology, ModelShape(tokens=n, hidden=mod.hidden,
                                                              params_per_layer=params, dtype_bytes=4), links)
    feats = workload_features(iteration_workload(CorpusSpec(**corpus), 0, par.dp, tr.microbatches),
                              par.dp, tr.microbatches)
    state = PlannerState.create(topology, plan, predictor, feats, capabilities=CAPABILITIES,
                                k_min=cfg.scheduler.k_min, delta=cfg.scheduler.delta)
    return plan, topology, spec, state, Planner(capabilities=CAPABILITIES)


def phases(faults: list) -> Callable[[int, int], str]:
    """Phase names for the report: healthy, then one per fault, marked once adapted."""
    ordered = sorted(faults, key=lambda f: f.iteration)
    first_gen: dict[int, int] = {}

    def phase_of(i: int, g: int) -> str:
        k = sum(1 for f in ordered if f.iteration <= i)
        if k == 0:
            return "1 healthy"
        f = ordered[k - 1]
        first_gen.setdefault(k, g)
        what = f"{f.kind} x{f.factor:.2f}" if f.kind == "slow" else f.kind
        return f"{k + 1} after {what} on device {f.device}" + (", adapted" if g > first_gen[k] else "")

    return phase_of


def run_demo(args: argparse.Namespace) -> int:
    if getattr(args, "adapter", "megatron_ref") == "deepspeed":
        from resihp_adapters.deepspeed.launch import run_demo as deepspeed_demo

        return deepspeed_demo(args)
    from resihp_core.config import Config
    from resihp_core.plan import ParallelPlan
    from resihp_plugins.faults import fail_at

    data = {**DEMO_CONFIG, "training": {**DEMO_CONFIG["training"], "iterations": args.iterations}}
    cfg = Config.from_dict(data, source="the demo")
    p = cfg.parallel
    layout = ParallelPlan.uniform(tp=p.tp, pp=p.pp, dp=p.dp, num_layers=cfg.model.layers,
                                  num_microbatches=cfg.training.microbatches)
    faults = [fail_at(layout.group(1, 1)[0], args.slow_at, "slow", severity=args.severity),
              fail_at(layout.group(0, 0)[1], args.kill_at, "kill")]
    return run_job(cfg, faults, args, "resihp demo: TP2 x PP2 x DP2 on CPU", "demo")


def run_config(args: argparse.Namespace) -> int:
    """``resihp run CONFIG [--faults FILE]``."""
    from resihp_core.cli import CliError
    from resihp_core.config import ConfigError, load_config
    from resihp_plugins.faults import FaultError, load_scenario

    try:
        cfg = load_config(args.config)
        faults = load_scenario(args.faults) if args.faults else []
    except (ConfigError, FaultError) as e:
        raise CliError(str(e)) from e
    p = cfg.parallel
    return run_job(cfg, faults, args, f"resihp run: TP{p.tp} x PP{p.pp} x DP{p.dp}", "run")


def _agents(cfg, args: argparse.Namespace) -> dict:
    """How ``run_resilient`` gets its agents: started here, or on each host by the user."""
    import os

    from resihp_core.cli import CliError
    from resihp_core.runtime.heartbeat import parse_address

    if getattr(args, "agents", "local") == "local":
        return {}
    rt = cfg.runtime
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
              f"--node <N>", flush=True)

    return dict(agents="external", listen=listen, secret=secret, on_listening=tell,
                agent_timeout=args.agent_timeout)


def run_job(cfg, faults: list, args: argparse.Namespace, title: str, tag: str) -> int:
    from resihp_core.runtime.resilient import run_resilient
    from resihp_adapters.megatron_ref.reference import reference_run
    from resihp_plugins.faults import repairs
    from resihp_plugins.report import format_table, summary_table, write_report

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outdir = Path(args.report) / f"{tag}-{stamp}"
    outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"resihp-{tag}-"))
    agents = _agents(cfg, args)
    plan, topology, spec, state, planner = build_job(cfg, faults, work)
    det = cfg.detector
    health = {d: "ok" for d in plan.devices()}

    def on_report(r):
        for d in r.devices:
            health[d] = "DEAD" if r.failure == "fail-stop" else f"slow {r.cause}"

    phase_of = phases(faults)

    view = _View(args, health)
    with view:
        run = run_resilient(spec.to_json(), plan, topology, state, planner, det, cfg.training.iterations,
                            work / "job", phase_of=phase_of, on_event=view.event,
                            on_iteration=view.iteration, on_report=on_report, repairs=repairs(faults),
                            **agents)
    if not run.ok:
        print(f"{tag} failed: {run.error}\nworker logs: {run.logs}", file=sys.stderr)
    records = run.records
    if not records:
        return 1
    import torch

    torch.set_num_threads(1)  # one thread: on a shared, loaded machine more threads thrash (measured 25 s vs 4 s)
    from resihp_adapters.megatron_ref.adapter import data_spec, model_config

    _, ref_losses = reference_run(model_config(spec), data_spec(spec), len(records), lr=spec.adapter_config["lr"])
    # Iteration 0 carries process start-up (imports, rendezvous): it is reported in the
    # events, not in the per-phase throughput or the iteration-time trace.
    startup = records[0].seconds
    iterations = [dict(iteration=r.iteration, loss=r.loss, seconds=r.seconds, samples=r.samples,
                       generation=r.generation, phase=r.phase) for r in records[1:]]
    ref_losses = ref_losses[1:]
    events = run.events + [dict(kind="injection", iteration=f.iteration, generation=0,
                                text=f"{f.kind} on device {f.device}" + (f" x{f.factor:.2f}" if f.kind == "slow" else ""))
                           for f in faults] + [dict(kind="start-up", iteration=0, generation=0,
                                                    text=f"start-up and first iteration {startup:.1f} s")]
    paths = write_report(outdir, iterations=iterations, events=events, reference_losses=ref_losses,
                         title=title)
    worst = max(abs(a["loss"] - b) / abs(b) for a, b in zip(iterations, ref_losses))
    print()
    print(format_table(summary_table(iterations)))
    print(f"\nloss vs fault-free reference: max relative difference {worst:.2e} ({cfg.training.dtype})")
    print("events:")
    for ev in run.events:
        print(f"  iteration {ev['iteration']:>3}  {ev['kind']:<8} {ev['text'][:110]}")
    print(f"\nreport: {outdir}")
    for name, p in paths.items():
        print(f"  {name}: {p}")
    return 0 if run.ok else 1


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

    def event(self, ev: dict) -> None:
        line = f"[iteration {ev['iteration']}] {ev['kind']}: {ev['text'][:120]}"
        self.lines.append(line)
        if self.live is not None:
            self.live.update(self._render())
        else:
            print(line, flush=True)


def configure_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job configuration (TOML or YAML; RESIHP_<SECTION>__<FIELD> overrides)")
    p.add_argument("--faults", help="fault scenario (JSON list of {device, iteration, kind, severity|factor|delay_s})")
    p.add_argument("--report", default="reports", help="parent folder of the report")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    p.add_argument("--agents", choices=["local", "external"], default="local",
                   help="local: start one agent process per node here (default); external: wait for "
                        "'resihp agent' on each host")
    p.add_argument("--listen", help="controller address for external agents (default: runtime.controller_host"
                                    ":runtime.controller_port)")
    p.add_argument("--agent-timeout", type=float, default=300.0,
                   help="seconds to wait for external agents to connect (default 300)")


@hookimpl
def resihp_register_commands(registry) -> None:
    """``resihp demo`` and ``resihp run CONFIG``."""
    registry.register("demo", "run the end-to-end demo (8 CPU workers, fail-slow then fail-stop)",
                      configure, run_demo)
    registry.register("run", "run a resilient job from a configuration file on this machine",
                      configure_run, run_config)
