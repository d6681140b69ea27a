"""``resihp demo``: a resilient TP2 x PP2 x DP2 job on this machine, end to end.

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

from resihp_core.hookspecs import hookimpl

__all__ = ["run_demo", "configure", "resihp_register_commands"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=36, help="training iterations (default 36)")
    p.add_argument("--slow-at", type=int, default=8, help="iteration of the compute fail-slow")
    p.add_argument("--kill-at", type=int, default=22, help="iteration of the SIGKILL")
    p.add_argument("--severity", default="strong", choices=["weak", "medium", "strong"])
    p.add_argument("--report", default="reports", help="parent folder of the report")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")


def _build(args: argparse.Namespace, workdir: Path):
    from resihp_core.adapter import Capabilities  # noqa: F401 - imported for side effects of typing
    from resihp_core.config import DetectorConfig
    from resihp_core.plan import ParallelPlan, Topology
    from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
    from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
    from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
    from resihp_core.scheduler.planner import Planner
    from resihp_core.scheduler.state import PlannerState
    from resihp_adapters.megatron_ref.plugin import CAPABILITIES
    from resihp_adapters.megatron_ref.worker import JobSpec
    from resihp_plugins.faults import fail_at

    tp, pp, dp, m, layers = 2, 2, 2, 4, 4
    plan = ParallelPlan.uniform(tp=tp, pp=pp, dp=dp, num_layers=layers, num_microbatches=m, num_heads=4)
    topology = Topology.uniform(2, 4)
    slow_dev = plan.group(1, 1)[0]
    kill_dev = plan.group(0, 0)[1]
    faults = [fail_at(slow_dev, args.slow_at, "slow", severity=args.severity),
              fail_at(kill_dev, args.kill_at, "kill")]
    corpus = dict(scale=24.0, shape=1.0, min_len=4, max_len=256, token_budget=256)
    spec = JobSpec(
        model=dict(vocab_size=256, hidden=64, num_heads=4, ffn_hidden=128, num_layers=layers, dtype="float32"),
        corpus=corpus, dp=dp, num_microbatches=m, lr=3e-3, timeout_s=10.0,
        checkpoint_dir=str(workdir / "checkpoints"), checkpoint_every=1,
        faults=[f.to_dict() for f in faults],
    )
    # Planning model: equal per-layer cost, CPU-ish links; the planner compares plans
    # relative to each other, the detector fits its own model from live profiles.
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8,
                                       ref_layers=layers // pp, ref_tp=1), pp)
    links = LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9, intra_latency=5e-5, inter_latency=1e-4)
    predictor = IterationPredictor(cost, topology, ModelShape(tokens=256, hidden=64, params_per_layer=50_000,
                                                              dtype_bytes=4), links)
    feats = workload_features(iteration_workload(CorpusSpec(**corpus), 0, dp, m), dp, m)
    state = PlannerState.create(topology, plan, predictor, feats, capabilities=CAPABILITIES)
    planner = Planner(capabilities=CAPABILITIES)
    det = DetectorConfig(heartbeat_interval_s=0.05, heartbeat_miss_limit=4, hang_min_timeout_s=20.0,
                         warmup_iterations=3, min_changepoint_gap=3)
    return plan, topology, spec, state, planner, det, faults, slow_dev, kill_dev


def run_demo(args: argparse.Namespace) -> int:
    from resihp_core.runtime.resilient import run_resilient
    from resihp_adapters.megatron_ref.reference import reference_run
    from resihp_plugins.report import format_table, summary_table, write_report

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outdir = Path(args.report) / f"demo-{stamp}"
    outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="resihp-demo-"))
    plan, topology, spec, state, planner, det, faults, slow_dev, kill_dev = _build(args, work)
    health = {d: "ok" for d in plan.devices()}

    def on_report(r):
        for d in r.devices:
            health[d] = "DEAD" if r.failure == "fail-stop" else f"slow {r.cause}"

    def phase_of(i: int, g: int) -> str:
        if i < args.slow_at:
            return "1 healthy"
        if i < args.kill_at:
            return "2 fail-slow" if g == 0 else "3 fail-slow, adapted"
        return "4 after fail-stop"

    view = _View(args, health)
    with view:
        run = run_resilient(spec.to_json(), plan, topology, state, planner, det, args.iterations,
                            work / "job", phase_of=phase_of, on_event=view.event,
                            on_iteration=view.iteration, on_report=on_report)
    if not run.ok:
        print(f"demo failed: {run.error}\nworker logs: {run.logs}", file=sys.stderr)
    records = run.records
    if not records:
        return 1
    _, ref_losses = reference_run(spec.model_config(), spec.data_spec(), len(records), lr=spec.lr)
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
                         title="resihp demo: TP2 x PP2 x DP2 on CPU")
    worst = max(abs(a["loss"] - b) / abs(b) for a, b in zip(iterations, ref_losses))
    print()
    print(format_table(summary_table(iterations)))
    print(f"\nloss vs fault-free reference: max relative difference {worst:.2e} (float32)")
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


@hookimpl
def resihp_register_commands(registry) -> None:
    """``resihp demo``."""
    registry.register("demo", "run the end-to-end demo (8 CPU workers, fail-slow then fail-stop)",
                      configure, run_demo)
