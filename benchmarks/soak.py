"""Soak: one long resilient job on this machine while random workers are killed, stopped
and slowed, and repaired, over and over (and, last, one node agent is killed).

    benchmarks/soak.py [--quick] [--failures N] [--seed S] [--json PATH]

The job is real (controller, 2 node agents, 4 workers, TP1 x PP2 x DP2, gloo on CPU, a
tiny float64 model, a checkpoint every iteration). A driver thread injects one failure
at a time, chosen at random:

- ``kill``: SIGKILL one executor's worker (fail-stop, state moved to the survivors);
- ``stop``: SIGSTOP one worker (a hang: the Detector's heartbeats find it, it is fenced);
- ``kill-stage``: SIGKILL every replica of one stage (no copy left: restore from the
  newest complete checkpoint and re-train the iterations after it);
- ``slow``: throttle one worker to about half speed for a few iterations (SIGSTOP /
  SIGCONT duty cycle: a real slowdown the Detector may or may not act on);
- ``agent``: the last failure: SIGKILL one node's agent (the node is lost, not repaired).

Killed and stopped devices are repaired afterwards (their workers start again and
rejoin); so is any device the job fenced after a false, load-induced report (counted as
``false_reports_repaired``), before the next failure. After each recovery (a commit in a newer plan generation) and each rejoin
it checks:

- micro-batch accounting, from the iteration reports of the generation that committed
  each iteration (re-trained ones included): every stage computed every one of the
  global batch's micro-batches exactly once; lost or doubled ones are counted;
- parameters and AdamW state of the newest complete checkpoint at or after the
  recovery (and after the repair) equal a fault-free single-process float64 run of the
  same micro-batches started from the job's last complete checkpoint before the
  failure (relative 1e-9), and so do the losses of the iterations in between;
- losses of the first 40 iterations equal the fault-free reference from the initial
  weights (relative 1e-9).

Why anchored: even two fault-free float64 runs that add gradients in a different order
drift apart through chaotic growth of rounding differences (about 1e-9 relative after
~75 iterations here, 1e-5 after ~105), so a comparison against one run from the
initial weights is meaningful only over a horizon. Anchoring every check at the
job's own checkpoint from just before the failure keeps each comparison within a few
iterations, where 1e-9 holds, for any length of soak.

It prints one row per failure and a summary, writes JSON (``--json``), and exits
non-zero if a check failed or the job did not finish. ``--quick`` injects 10 failures;
the full run injects ``--failures`` (default 100).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = dict(
    parallel=dict(tp=1, pp=2, dp=2),
    model=dict(layers=4, hidden=32, heads=4, vocab=64, ffn_hidden=64),
    training=dict(microbatches=2, token_budget=64, dtype="float64", lr=3e-3, checkpoint_every=1, checkpoint_keep=4),
    runtime=dict(nodes=2, devices_per_node=2),
    # Heartbeats every 0.1 s, 4 s of silence to declare a hang, and a fail-slow only
    # beyond 2x the prediction: a loaded shared machine starves processes for seconds
    # now and then, and a false report during an outage can leave too few devices.
    detector=dict(heartbeat_interval_s=0.1, heartbeat_miss_limit=40, hang_min_timeout_s=30.0,
                  warmup_iterations=3, min_changepoint_gap=3, slow_threshold=1.0),
)
SPACING = 5  # committed iterations between the end of one recovery and the next failure
TOL = 1e-9
HORIZON = 40  # iterations over which the run from the initial weights is a meaningful reference


class Soak:
    def __init__(self, failures: int, seed: int, work: Path, keep: int = 4) -> None:
        from resihp_core.config import Config
        from resihp_core.runtime.jobs import build_job

        self.failures, self.rng, self.work = failures, random.Random(seed), work
        self.iterations = failures * (SPACING + 40) + 20  # a repaired worker starts in ~10 s: training goes on
        cfg = dict(CONFIG, training=dict(CONFIG["training"], iterations=self.iterations, checkpoint_keep=keep))
        self.cfg = Config.from_dict(cfg, source="soak")
        self.assembled = build_job(self.cfg, [], work)
        self.spec = self.assembled.spec
        self.ckpt = Path(self.spec.checkpoint_dir)
        self.lock = threading.Condition()
        self.records: list = []
        self.pending: set[int] = set()  # re-trained iterations to account again
        self.accounting = dict(lost=0, doubled=0, iterations_checked=0, loss_checks=0, loss_failures=0)
        self.problems: list[str] = []
        self.losses: dict[int, float] = {}  # iteration -> loss of the generation that committed it last
        self.anchor: tuple[int, dict] | None = None
        self.rows: list[dict] = []
        self.repairs: queue.Queue = queue.Queue()
        self.stray_repairs = 0  # devices repaired after a false report fenced them
        self.job = None
        self.agents: dict = {}
        self.done = threading.Event()
        self._reference()

    # ------------------------------------------------------------ reference
    def _reference(self) -> None:
        import torch

        from resihp_adapters.megatron_ref.adapter import data_spec, model_config
        from resihp_adapters.megatron_ref.reference import reference_trajectory

        torch.set_num_threads(1)
        t0 = time.perf_counter()
        self.ref_loss, self.ref_state = [], []
        self.model, self.data = model_config(self.spec), data_spec(self.spec)
        self.lr = float(self.spec.adapter_config["lr"])
        for _, loss, st in reference_trajectory(self.model, self.data, min(HORIZON, self.iterations), lr=self.lr):
            self.ref_loss.append(loss)
        print(f"fault-free float64 reference of {HORIZON} iterations: {time.perf_counter() - t0:.1f} s", flush=True)

    # ------------------------------------------------------------ supervisor-side hooks
    def on_iteration(self, rec) -> None:
        """Runs on the supervisor's thread: the job store's reports are safe to read."""
        job = self.job
        todo = sorted(i for i in self.pending if i < job.committed) + [rec.iteration]
        self.pending.difference_update(todo)
        for i in todo:
            self._account(i)
        with self.lock:
            self.records.append(rec)
            self.lock.notify_all()

    def on_event(self, ev: dict) -> None:
        if ev["kind"] in ("plan", "checkpoint", "storage", "failure"):
            extra = f" resume={ev.get('resume')}" if ev["kind"] == "plan" else ""
            print(f"      [it {ev['iteration']} gen {ev['generation']}] {ev['kind']}: {ev['text'][:140]}{extra}",
                  flush=True)
        if ev["kind"] == "plan" and ev.get("resume") is not None:
            with self.lock:
                self.pending.update(range(ev["resume"], len(self.records)))
        with self.lock:
            self.events.append(ev)
            self.lock.notify_all()

    def _account(self, i: int) -> None:
        job = self.job
        g = job.committed_in.get(i, job.generation)
        plan = job.plans[g]
        reports = job.report(i)
        want = Counter(range(self.spec.dp * self.spec.num_microbatches))
        for s in range(plan.pp):
            got = Counter(o * plan.num_microbatches + j for r in reports.values() for (st, o, j) in r.computed
                          if st == s)
            lost, doubled = sum((want - got).values()), sum((got - want).values())
            self.accounting["lost"] += lost
            self.accounting["doubled"] += doubled
            if lost or doubled:
                self.problems.append(f"iteration {i} stage {s} (generation {g}): {lost} lost, {doubled} doubled")
        if not reports:
            have = [gg for gg in sorted(job.plans) if any(job.store.check([f"ctl{gg}/report/{i}/{d}"])
                                                           for d in job.plans[gg].devices())]
            verdicts = {gg: job.store.get(f"ctl{gg}/verdict{i}").decode() for gg in sorted(job.plans)
                        if job.store.check([f"ctl{gg}/verdict{i}"])}
            self.problems.append(f"iteration {i}: no reports in generation {g} (committed_in); reports in {have}; "
                                 f"verdicts {verdicts}; committed {job.committed}; records {len(self.records)}")
        loss = sum(r.loss for r in reports.values())
        self.losses[i] = loss
        self.accounting["iterations_checked"] += 1
        if i < len(self.ref_loss):
            self.accounting["loss_checks"] += 1
            ref = self.ref_loss[i]
            if abs(loss - ref) > TOL * abs(ref):
                self.accounting["loss_failures"] += 1
                self.problems.append(f"iteration {i}: loss {loss!r} != reference {ref!r}")

    # ------------------------------------------------------------ driver helpers
    def committed(self) -> int:
        with self.lock:
            return len(self.records)

    def wait(self, pred, timeout: float = 240.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not pred():
                if self.done.is_set() or time.monotonic() > deadline:
                    return False
                self.lock.wait(0.2)
        return True

    def commit_after(self, generation: int, timeout: float = 240.0):
        """The first iteration committed in a generation newer than ``generation``."""
        hit: list = []

        def pred():
            hit[:] = [r for r in self.records if r.generation > generation]
            return bool(hit)

        return hit[0] if self.wait(pred, timeout) and hit else None

    def pid(self, device: int) -> int | None:
        """The worker's process id, from the job store (this process hosts it)."""
        key = f"worker/{device}/pid"
        try:
            return int(self.job.store.get(key)) if self.job.store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None

    def take_anchor(self) -> None:
        """Keep the newest complete checkpoint (before a failure) in memory."""
        from resihp_core import checkpoints
        from resihp_adapters.torchkit.checkpoint import CheckpointError, load_component

        for _ in range(100):
            it, _ = checkpoints.newest_complete(self.ckpt)
            if it is not None:
                try:
                    self.anchor = (it, self._load(it, load_component))
                    return
                except (CheckpointError, FileNotFoundError):
                    pass  # pruned meanwhile
            time.sleep(0.05)

    def _load(self, it: int, load) -> dict:
        out = {}
        for c in ["embed", *(f"layers.{i}" for i in range(self.cfg.model.layers)), "head"]:
            out.update({name: tuple(ts) for name, ts in load(self.ckpt, it, c).items()})
        return out

    def check_params(self, at_least: int) -> tuple[int, float] | None:
        """Newest complete checkpoint of an iteration >= ``at_least`` against the
        fault-free run from the anchor checkpoint; the losses in between too."""
        from resihp_core import checkpoints
        from resihp_adapters.torchkit.checkpoint import CheckpointError, load_component

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            it, _ = checkpoints.newest_complete(self.ckpt)
            if it is not None and it >= at_least:
                try:
                    got = self._load(it, load_component)
                except (CheckpointError, FileNotFoundError):
                    time.sleep(0.05)
                    continue  # retention deleted it meanwhile: take the next one
                err = self._compare(it, got)
                if err <= TOL:
                    self.anchor = (it, got)  # verified: the next checks continue from here
                else:
                    self._diagnose(it)
                return it, err
            time.sleep(0.05)
        return None

    def _compare(self, it: int, got: dict, *, losses: bool = True) -> float:
        from resihp_adapters.megatron_ref.reference import reference_trajectory

        a, state = self.anchor if self.anchor is not None else (-1, None)
        ref = state
        for j, loss, ref in reference_trajectory(self.model, self.data, it + 1, lr=self.lr, start=a + 1,
                                                 state=state):
            have = self.losses.get(j)
            if losses and have is not None and abs(have - loss) > TOL * abs(loss):
                self.problems.append(f"iteration {j}: loss {have!r} != reference from checkpoint {a}: {loss!r}")
        worst, self.worst_tensor = 0.0, ""
        if set(got) != set(ref):
            raise ValueError(f"checkpoint {it} has parameters {sorted(set(got) ^ set(ref))} differing")
        for name, tensors in got.items():
            for what, g, exp in zip(("param", "exp_avg", "exp_avg_sq"), tensors, ref[name]):
                err = ((g - exp).abs().max() / exp.abs().max().clamp_min(1e-30)).item()
                if err > worst:
                    worst, self.worst_tensor = err, f"{name} {what}"
        return worst

    def _diagnose(self, it: int) -> None:
        """A failed parameter check: say which tensor is worst, and how the error grew
        over the checkpoints still kept between the anchor and ``it``."""
        from resihp_core import checkpoints
        from resihp_adapters.torchkit.checkpoint import CheckpointError, load_component

        worst = self.worst_tensor
        a = self.anchor[0] if self.anchor else -1
        seen = []
        for info in checkpoints.scan(self.ckpt):
            if info.complete and a < info.iteration:
                try:
                    err = self._compare(info.iteration, self._load(info.iteration, load_component), losses=False)
                except (CheckpointError, FileNotFoundError, ValueError):
                    continue
                seen.append(f"{info.iteration}: {err:.1e} ({self.worst_tensor})")
        gens = {i: self.job.committed_in.get(i) for i in range(a, it + 1)}
        self.problems.append(f"checkpoint {it} vs reference from {a}: worst {worst}; kept checkpoints "
                             f"{'; '.join(seen)}; committed in generations {gens}")

    # ------------------------------------------------------------ failures
    def executors(self) -> list[int]:
        return sorted(self.job.plan.devices())

    def choose(self, k: int) -> tuple[str, list[int]]:
        live = self.executors()
        if k == self.failures - 1 and len(self.agents) > 1:
            return "agent", []
        kind = self.rng.choices(["kill", "stop", "slow", "kill-stage"], [0.35, 0.2, 0.25, 0.2])[0]
        plan = self.job.plan
        if kind == "kill-stage":
            stages = [s for s in range(plan.pp)
                      if len([r for r in range(plan.dp) if plan.group(r, s)]) >= 1]
            s = self.rng.choice(stages)
            return kind, sorted(d for r in range(plan.dp) for d in plan.group(r, s))
        return kind, [self.rng.choice(live)]

    def slow(self, device: int, iterations: int) -> None:
        """About 2x slower: stopped 30 ms of every 60 ms for ``iterations`` commits."""
        pid = self.pid(device)
        end = self.committed() + iterations
        try:
            while self.committed() < end and not self.done.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.03)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.03)
        except (ProcessLookupError, TypeError):
            pass
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, TypeError):
                pass

    def drive(self) -> None:
        try:
            self._drive()
        except Exception as e:  # noqa: BLE001 - a driver bug must show, not hang the soak
            self.problems.append(f"driver: {type(e).__name__}: {e}")

    def repair(self, devices: list[int], timeout: float = 240.0):
        """Offer ``devices`` for repair and wait until a rejoin plan brought every one
        back and an iteration committed after it; returns that record (None: it did not)."""
        g1 = self.job.generation
        self.repairs.put(list(devices))
        back: dict[int, int] = {}

        def rejoined() -> bool:
            for e in self.events:
                if e["kind"] == "plan" and e.get("kind_of_plan") == "rejoin" and e["generation"] > g1:
                    back.update({d: e["generation"] for d in e.get("devices", ()) if d in devices})
            return set(back) >= set(devices)

        if not self.wait(rejoined, timeout):
            return None
        return self.commit_after(max(back.values()) - 1, timeout)

    def stray(self) -> list[int]:
        """Devices the job lost that no injected failure took (a load-induced false
        report fenced them), on nodes whose agent is alive: repaired like the others."""
        lost_nodes = {n for n, a in self.agents.items() if a.poll() is not None}
        return sorted(d for d in self.job.dead() if self.node_of.get(d) not in lost_nodes)

    def _drive(self) -> None:
        next_at = 5
        for k in range(self.failures):
            if next_at + SPACING + 2 >= self.iterations:
                self.problems.append(f"iteration budget spent after {k} failures")
                return
            if not self.wait(lambda: len(self.records) >= next_at):
                self.problems.append(f"failure {k}: the job stopped committing before iteration {next_at}")
                return
            if stray := self.stray():
                print(f"      devices {stray} were fenced after a false report: repairing them", flush=True)
                self.stray_repairs += len(stray)
                if self.repair(stray) is None:
                    self.problems.append(f"before failure {k + 1}: the repair of fenced devices {stray} "
                                         "did not come back")
                    return
                next_at = len(self.records) + SPACING
                if not self.wait(lambda: len(self.records) >= next_at):
                    self.problems.append(f"failure {k}: the job stopped committing before iteration {next_at}")
                    return
            self.take_anchor()
            kind, devices = self.choose(k)
            g0, at = self.job.generation, len(self.records)
            t0 = time.monotonic()
            row = dict(n=k + 1, kind=kind, devices=devices, iteration=at)
            if kind in ("kill", "kill-stage"):
                for d in devices:
                    pid = self.pid(d)
                    if pid:
                        os.kill(pid, signal.SIGKILL)
            elif kind == "stop":
                pid = self.pid(devices[0])
                if pid:
                    os.kill(pid, signal.SIGSTOP)
            elif kind == "agent":
                node = max(self.agents)
                devices = sorted(d for d, n in self.node_of.items() if n == node)
                row["devices"] = devices
                self.agents[node].kill()
            elif kind == "slow":
                self.slow(devices[0], 6)
            if kind == "slow":  # no generation need change: the recovery is the slowdown's end
                rec = self.records[-1] if self.wait(lambda: len(self.records) > at) else None
            else:
                rec = self.commit_after(g0)
            if rec is None:
                self.problems.append(f"failure {k + 1} ({kind} of {devices}): no recovery")
                row["recovered"] = False
                self.rows.append(row)
                return
            row.update(recovered=True, recovery_s=round(time.monotonic() - t0, 2),
                       plans=[e["text"].split("(", 1)[1].split(",")[0] for e in self.events
                              if e["kind"] == "plan" and e["generation"] > g0][:3],
                       fallback=any(e["kind"] == "checkpoint" and e["generation"] >= g0 for e in self.events))
            got = self.check_params(rec.iteration)
            row["param_iteration"], row["param_err"] = (got if got else (None, None))
            if got is None or got[1] > TOL:
                self.problems.append(f"failure {k + 1}: parameter check after recovery failed: {got}")
            if kind in ("kill", "kill-stage", "stop"):
                deadline = time.monotonic() + 60
                while set(devices) - set(self.job.dead()) and time.monotonic() < deadline:
                    time.sleep(0.05)  # a stopped worker is fenced (SIGKILL) by the supervisor
                rec = self.repair(devices)
                if rec is None:
                    self.problems.append(f"failure {k + 1}: the repair of {devices} did not come back")
                    self.rows.append(row)
                    return
                got = self.check_params(rec.iteration)
                row["repair_param_err"] = got[1] if got else None
                if got is None or got[1] > TOL:
                    self.problems.append(f"failure {k + 1}: parameter check after the repair failed: {got}")
                row["repaired_s"] = round(time.monotonic() - t0, 2)
            self.rows.append(row)
            print(_row_text(row), flush=True)
            next_at = len(self.records) + SPACING
        # The rest of the job: verified every 15 iterations, so the final check's
        # reference starts at most that far back.
        while not self.done.is_set() and len(self.records) + 1 < self.iterations:
            n = len(self.records)
            if not self.wait(lambda: len(self.records) >= min(n + 15, self.iterations - 1), 120):
                break
            got = self.check_params(len(self.records) - 1)
            if got is not None and got[1] > TOL:
                self.problems.append(f"parameter check at iteration {got[0]} failed: {got[1]:.3g}")

    # ------------------------------------------------------------ run
    def run(self) -> dict:
        from resihp_core.runtime.resilient import run_resilient

        a = self.assembled
        self.events: list[dict] = []
        self.node_of = {d: n for n, devs in a.topology.nodes().items() for d in devs}

        def before_run(job, agents):
            self.job, self.agents = job, agents
            threading.Thread(target=self.drive, daemon=True, name="soak-driver").start()

        t0 = time.monotonic()
        run = run_resilient(a.spec.to_json(), a.plan, a.topology, a.state, a.planner, self.cfg.detector,
                            self.iterations, self.work / "job", on_iteration=self.on_iteration,
                            on_event=self.on_event, before_run=before_run, repair_requests=self.repairs,
                            timeout=max(900.0, self.failures * 60.0))
        wall = time.monotonic() - t0
        self.done.set()
        if not run.ok:
            self.problems.append(f"job failed: {run.error} (logs {run.logs})")
        final = None
        if len(run.records) == self.iterations:
            from resihp_adapters.torchkit.checkpoint import load_component

            try:
                final = self._compare(self.iterations - 1, self._load(self.iterations - 1, load_component))
            except Exception as e:  # noqa: BLE001
                self.problems.append(f"final checkpoint: {type(e).__name__}: {e}")
            if final is not None and final > TOL:
                self.problems.append(f"final parameters differ from the reference: {final:.3g}")
        survived = sum(1 for r in self.rows if r.get("recovered"))
        checks = [r.get(k) for r in self.rows for k in ("param_err", "repair_param_err") if k in r]
        return dict(
            failures_injected=len(self.rows), failures_survived=survived,
            device_failures=sum(len(r["devices"]) for r in self.rows),
            by_kind=dict(Counter(r["kind"] for r in self.rows)),
            restores_with_fallback=sum(1 for r in self.rows if r.get("fallback")),
            false_reports_repaired=self.stray_repairs,
            lost_microbatches=self.accounting["lost"], doubled_microbatches=self.accounting["doubled"],
            iterations=len(run.records), iterations_accounted=self.accounting["iterations_checked"],
            loss_checks=self.accounting["loss_checks"], loss_failures=self.accounting["loss_failures"],
            parameter_checks=len(checks), parameter_checks_passed=sum(1 for c in checks if c is not None and c <= TOL),
            worst_parameter_error=max((c for c in checks if c is not None), default=None),
            final_parameter_error=final, storage_faults=sum(1 for e in run.events if e["kind"] == "storage"),
            wall_s=round(wall, 1), loadavg=open("/proc/loadavg").read().split()[:3],
            problems=self.problems, rows=self.rows, ok=run.ok and not self.problems,
        )


def _row_text(r: dict) -> str:
    err = r.get("param_err")
    rep = r.get("repair_param_err")
    return (f"{r['n']:>4}  {r['kind']:<10} {str(r['devices']):<8} it {r['iteration']:>4}  "
            f"recovered {str(r.get('recovered', '-')):<5} {r.get('recovery_s', '-'):>6}s  "
            f"{','.join(r.get('plans', []))[:30]:<30} {'fallback' if r.get('fallback') else '':<8} "
            f"params {'-' if err is None else f'{err:.1e}'} / repaired {'-' if rep is None else f'{rep:.1e}'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 failures instead of --failures")
    ap.add_argument("--failures", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (worker logs, checkpoints)")
    ap.add_argument("--checkpoint-keep", type=int, default=4,
                    help="checkpoints retained (more: a failed check can say where the error grew)")
    args = ap.parse_args()
    n = 10 if args.quick else args.failures
    if n < 2:
        ap.error("--failures must be >= 2")
    with tempfile.TemporaryDirectory(prefix="resihp-soak-", ignore_cleanup_errors=True) as tmp:
        if args.keep:
            tmp = tempfile.mkdtemp(prefix="resihp-soak-kept-")
        soak = Soak(n, args.seed, Path(tmp), keep=args.checkpoint_keep)
        print(f"soak: {n} failures, {soak.iterations} iterations budget, TP1 x PP2 x DP2 on 2 nodes, float64, "
              f"checkpoint every iteration (newest {args.checkpoint_keep} kept); work folder {tmp}", flush=True)
        print("   n  kind       devices  at      recovery          plans                          "
              "         parameter error (after recovery / after repair)", flush=True)
        res = soak.run()
    print()
    width = max(len(k) for k in res if k not in ("rows", "problems"))
    for k, v in res.items():
        if k not in ("rows", "problems"):
            print(f"  {k:<{width}}  {v}")
    for p in res["problems"]:
        print(f"  PROBLEM: {p}")
    print(f"\nsoak {'passed' if res['ok'] else 'FAILED'}: {res['failures_survived']}/{n} failures survived, "
          f"{res['lost_microbatches']} lost / {res['doubled_microbatches']} doubled micro-batches, "
          f"{res['parameter_checks_passed']}/{res['parameter_checks']} parameter checks, {res['wall_s']} s "
          f"(load {' '.join(res['loadavg'])})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0 if res["ok"] and res["failures_survived"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
