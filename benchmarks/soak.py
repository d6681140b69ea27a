"""Soak: one long resilient job on this machine while random workers are killed, stopped
and slowed, and repaired, over and over (and, last, one node agent is killed).

    benchmarks/soak.py [--quick] [--adapter A] [--failures N] [--seed S] [--json PATH]

The job is real (controller, 2 node agents, 4 workers, TP1 x PP2 x DP2, gloo on CPU, a
tiny float64 model, a checkpoint every iteration), on any first-party adapter
(``--adapter``: megatron_ref, the default; torch_native, FSDP2; deepspeed, its toy
model). Each adapter's checkpoints are read in the format it writes and stepped by a
single-process reference of that adapter's model (``soak_formats.py``). A driver thread injects one failure
at a time, chosen at random:

- ``kill``: SIGKILL one executor's worker (fail-stop, state moved to the survivors);
- ``stop``: SIGSTOP one worker (the Detector's heartbeats find it paused, it is fenced;
  its repair is SIGCONT: the same process is planned back in);
- ``kill-stage``: SIGKILL every replica of one stage (no copy left: restore from the
  newest complete checkpoint and re-train the iterations after it);
- ``slow``: throttle one worker to about half speed for a few iterations (SIGSTOP /
  SIGCONT duty cycle: a real slowdown the Detector may or may not act on);
- ``agent``: the last failure: SIGKILL one node's agent (the node is lost, not repaired).

Killed devices are repaired afterwards (their workers start again and
rejoin); so is any device the job fenced after a false, load-induced report (counted as
``false_reports_repaired``), before the next failure. It checks:

- micro-batch accounting, from the iteration reports of the generation that committed
  each iteration (re-trained ones included): every stage computed every one of the
  global batch's micro-batches exactly once; lost or doubled ones are counted;
- every committed iteration, one step at a time: checkpoint ``k`` (parameters and
  AdamW state) equals one fault-free single-process float64 step of iteration ``k``'s
  micro-batches from checkpoint ``k - 1`` (relative 1e-9), and so does the iteration's
  loss. The job keeps every checkpoint; the soak verifies them while it waits between
  failures (and the backlog when the job ends) and deletes each one once verified. A
  checkpoint a failure left incomplete is bridged by a few reference steps. Each
  failure's row reports the worst step error through its recovery and its repair.

Why one step at a time: two float64 runs that add gradients in a different order (a
degraded plan does) differ by rounding, and this model's training amplifies that
difference chaotically: on a soak's own trajectory the state's difference passed 1e-9
within 17-24 iterations and the loss's reached 1e-8..1e-7 after 35-45
(``benchmarks/soak_sensitivity.py``). A
comparison over a degraded phase of 20-40 iterations against one run from an earlier
checkpoint therefore fails without any fault in the job; a one-step comparison has no
such horizon, for any length of soak.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_formats import FIELDS  # noqa: E402

CONFIG = dict(
    parallel=dict(tp=1, pp=2, dp=2),
    model=dict(layers=4, hidden=32, heads=4, vocab=64, ffn_hidden=64),
    # Every checkpoint is kept until the soak has verified it (then it deletes it).
    training=dict(microbatches=2, token_budget=64, dtype="float64", lr=3e-3, checkpoint_every=1, checkpoint_keep=0),
    runtime=dict(nodes=2, devices_per_node=2),
    # Heartbeats every 0.1 s, 4 s of silence to declare a hang, and a fail-slow only
    # beyond 2x the prediction: a loaded shared machine starves processes for seconds
    # now and then, and a false report during an outage can leave too few devices.
    detector=dict(heartbeat_interval_s=0.1, heartbeat_miss_limit=40, hang_min_timeout_s=30.0,
                  warmup_iterations=3, min_changepoint_gap=3, slow_threshold=1.0),
)
# What differs per adapter: which one runs, and its [adapter] table.
ADAPTERS: dict[str, dict] = {
    "megatron_ref": {},
    "torch_native": dict(shard=0),  # FSDP2: a killed replica takes its shard with it
    "deepspeed": dict(model="resihp_adapters.deepspeed.toy:build", hidden=32, num_layers=4, micro_batch_size=2,
                      lr=3e-3, dtype="float64"),
}
SPACING = 5  # committed iterations between the end of one recovery and the next failure
TOL = 1e-9
BRIDGE = 4  # most reference steps between two verified checkpoints (incomplete ones between)
BEHIND = 8  # verified checkpoints kept behind the newest verified one (a restore may go back to them)


class Soak:
    def __init__(self, failures: int, seed: int, work: Path, adapter: str = "megatron_ref") -> None:
        from resihp_core.config import Config
        from resihp_core.runtime.controller.jobs import build_job

        self.failures, self.rng, self.work, self.adapter = failures, random.Random(seed), work, adapter
        # A repaired worker takes seconds to start while training goes on: on a fast,
        # quiet machine a failure and its repair span up to ~60 iterations.
        self.iterations = failures * (SPACING + 65) + 20
        cfg = dict(CONFIG, training=dict(CONFIG["training"], iterations=self.iterations),
                   runtime=dict(CONFIG["runtime"], adapter=adapter))
        if ADAPTERS[adapter]:
            cfg["adapter"] = dict(ADAPTERS[adapter])
        self.cfg = Config.from_dict(cfg, source="soak")
        self.assembled = build_job(self.cfg, [], work)
        self.spec = self.assembled.spec
        self.ckpt = Path(self.spec.checkpoint_dir)
        self.lock = threading.Condition()
        self.records: list = []
        self.pending: set[int] = set()  # re-trained iterations to account again
        self.accounting = dict(lost=0, doubled=0, iterations_checked=0, worst_step_error=0.0, loss_checks=0,
                               loss_failures=0)
        self.checked: set[int] = set()  # iterations verified step by step
        self.problems: list[str] = []
        self.losses: dict[int, float] = {}  # iteration -> loss of the generation that committed it last
        self.verified: tuple[int, dict | None] = (-1, None)  # newest verified checkpoint (-1: the seed)
        self.rewind: int | None = None  # a restore re-trains from here: the chain goes back to it
        self.step_err: dict[int, float] = {}  # iteration -> error of the step that verified it
        self.pruned = 0  # checkpoints before this one are deleted
        self.rows: list[dict] = []
        self.events: list[dict] = []
        self.repairs: queue.Queue = queue.Queue()
        self.stray_repairs = 0  # devices repaired after a false report fenced them
        self.job = None
        self.agents: dict = {}
        self.done = threading.Event()
        self._reference_inputs()

    # ------------------------------------------------------------ reference
    def _reference_inputs(self) -> None:
        """The adapter's checkpoint reader and fault-free reference (soak_formats.py)."""
        import torch

        from soak_formats import format_for

        torch.set_num_threads(1)
        self.fmt = format_for(self.spec)

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
        """A job event as ``events.json`` holds it (the soak's record keeps that form)."""
        if ev["kind"] in ("plan", "checkpoint", "storage", "failure"):
            extra = f" resume={ev.get('resume')}" if ev["kind"] == "plan" else ""
            print(f"      [it {ev['iteration']} gen {ev['generation']}] {ev['kind']}: {ev['text'][:140]}{extra}",
                  flush=True)
        if ev["kind"] == "plan" and ev.get("resume") is not None:
            with self.lock:
                self.pending.update(range(ev["resume"], len(self.records)))
                r = ev["resume"] - 1  # the checkpoint it restored (or the seed): re-verify after it
                self.rewind = r if self.rewind is None else min(self.rewind, r)
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
            from resihp_core.runtime import session

            have = [gg for gg in sorted(job.plans) if any(session.get_report(job.store, gg, i, d) is not None
                                                           for d in job.plans[gg].devices())]
            verdicts = {gg: v for gg in sorted(job.plans) if (v := session.verdict(job.store, gg, i)) is not None}
            self.problems.append(f"iteration {i}: no reports in generation {g} (committed_in); reports in {have}; "
                                 f"verdicts {verdicts}; committed {job.committed}; records {len(self.records)}")
        self.losses[i] = sum(r.loss for r in reports.values())
        self.accounting["iterations_checked"] += 1

    # ------------------------------------------------------------ driver helpers
    def committed(self) -> int:
        with self.lock:
            return len(self.records)

    def wait(self, pred, timeout: float = 240.0) -> bool:
        """Wait for ``pred`` (under the lock), verifying checkpoints meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if pred():
                    return True
                if self.done.is_set() or time.monotonic() > deadline:
                    return False
                self.lock.wait(0.05)
            self.advance(budget_s=0.5)

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

    # ------------------------------------------------------------ step-by-step verification
    def _load(self, it: int) -> dict:
        return self.fmt.load(self.ckpt, it)

    def _complete(self, it: int) -> bool:
        return self.fmt.complete(self.ckpt, it)

    def advance(self, upto: int | None = None, budget_s: float = float("inf")) -> None:
        """Verify the committed iterations after the newest verified checkpoint (up to
        ``upto``), each checkpoint against fault-free reference steps from the previous
        verified one; stops when nothing newer is complete or ``budget_s`` is spent."""
        from soak_formats import CheckpointUnreadable

        t0, unreadable = time.monotonic(), 0
        while time.monotonic() - t0 < budget_s:
            with self.lock:
                rewind, self.rewind = self.rewind, None
            committed = self.job.committed
            if rewind is not None and rewind < self.verified[0]:
                try:  # the job restored checkpoint ``rewind`` (verified before) and re-trains after it
                    self.verified = (rewind, self._load(rewind) if rewind >= 0 else None)
                except CheckpointUnreadable as e:
                    self.problems.append(f"checkpoint {rewind} the job restored could not be read: {e}")
                    return
            v, state = self.verified
            last = committed - 1 if upto is None else min(upto, committed - 1)
            nxt = next((k for k in range(v + 1, min(v + BRIDGE, last) + 1) if self._complete(k)), None)
            if nxt is None:
                later = next((k for k in range(v + BRIDGE + 1, last + 1) if self._complete(k)), None)
                if later is not None:  # never expected: the job writes every iteration's checkpoint
                    self.problems.append(f"checkpoints {v + 1}..{later - 1} are incomplete: that stretch "
                                         "cannot be verified")
                    self.verified = (later, self._load(later))  # go on from there, unverified
                return
            if any(j not in self.losses for j in range(v + 1, nxt + 1)):
                return  # committed, but its reports are not accounted yet
            try:
                got = self._load(nxt)
            except CheckpointUnreadable as e:
                unreadable += 1
                if unreadable > 100:
                    self.problems.append(f"checkpoint {nxt} stays unreadable: {e}")
                    return
                time.sleep(0.02)  # a newer generation is rewriting it: read it again
                continue
            ref = state
            for j, loss, ref in self.fmt.steps(state, v + 1, nxt + 1):
                have = self.losses[j]
                self.accounting["loss_checks"] += 1
                if abs(have - loss) > TOL * abs(loss):
                    self.accounting["loss_failures"] += 1
                    self.problems.append(f"iteration {j} (generation {self.job.committed_in.get(j)}): loss "
                                         f"{have!r} != {loss!r}, one fault-free step from checkpoint {j - 1}")
            err, worst = self._error(got, ref)
            self.checked.update(range(v + 1, nxt + 1))
            self.step_err.update(dict.fromkeys(range(v + 1, nxt + 1), err))
            self.accounting["worst_step_error"] = max(self.accounting["worst_step_error"], err)
            if err > TOL:
                self.problems.append(f"checkpoint {nxt} (generation {self.job.committed_in.get(nxt)}) differs from "
                                     f"{nxt - v} fault-free step(s) from checkpoint {v} by {err:.2g} ({worst})")
            self.verified = (nxt, got)
            self._prune(nxt - BEHIND)

    @staticmethod
    def _error(got: dict, ref: dict) -> tuple[float, str]:
        """Worst relative difference over every parameter and AdamW tensor (and AdamW's
        step count where the format stores it), and where."""
        if set(got) != set(ref):
            raise ValueError(f"parameters {sorted(set(got) ^ set(ref))} differ between checkpoint and reference")
        worst, where = 0.0, ""
        for name, tensors in got.items():
            for what, g, exp in zip(FIELDS, tensors, ref[name]):
                g, exp = g.double(), exp.double()
                err = ((g - exp).abs().max() / exp.abs().max().clamp_min(1e-30)).item()
                if err > worst:
                    worst, where = err, f"{name} {what}"
        return worst, where

    def _prune(self, before: int) -> None:
        """Delete the verified checkpoints before ``before`` (the job keeps them all)."""
        import shutil

        from resihp_core import checkpoints

        for k in range(self.pruned, before):
            shutil.rmtree(checkpoints.iteration_dir(self.ckpt, k), ignore_errors=True)
        self.pruned = max(self.pruned, before)

    def worst_between(self, first: int, last: int) -> float | None:
        """Worst step error over iterations ``first``..``last`` (None: one is not verified)."""
        errs = [self.step_err.get(i) for i in range(first, last + 1)]
        return None if None in errs else max(errs, default=0.0)

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
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]
            self.problems.append(f"driver: {type(e).__name__}: {e} (line {where.lineno}: {where.line})")

    def repair(self, devices: list[int], timeout: float = 240.0, *, offer: bool = True):
        """Offer ``devices`` for repair (``offer``; a resumed paused worker offers itself)
        and wait until a rejoin plan brought every one back and an iteration committed
        after it; returns that record (None: it did not)."""
        g1 = self.job.generation
        if offer:
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
                stopped = self.pid(devices[0])
                if stopped:
                    os.kill(stopped, signal.SIGSTOP)
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
            row["recovered_at"] = rec.iteration
            if kind in ("kill", "kill-stage", "stop"):
                if kind == "stop":
                    # A stopped worker is fenced, not killed (paused, docs/detector.md): its
                    # repair is to let it run again; it passes its health check and is
                    # planned back in by a rejoin, the same process.
                    if stopped:
                        os.kill(stopped, signal.SIGCONT)
                    rec = self.repair(devices, offer=False)
                else:
                    deadline = time.monotonic() + 60
                    while set(devices) - set(self.job.dead()) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    rec = self.repair(devices)
                if rec is None:
                    self.problems.append(f"failure {k + 1}: the repair of {devices} did not come back")
                    self.rows.append(row)
                    return
                row["repaired_at"] = rec.iteration
                row["repaired_s"] = round(time.monotonic() - t0, 2)
            self.rows.append(row)
            print(_row_text(row), flush=True)
            next_at = len(self.records) + SPACING
        # The rest of the job is verified as it commits (wait() advances the chain).
        self.wait(lambda: False, timeout=float("inf"))

    # ------------------------------------------------------------ run
    def run(self) -> dict:
        from resihp_core.protocols.events import event_dicts, observer
        from resihp_core.runtime.controller.resilient import ResilientConfig, RunHooks, run_resilient

        a = self.assembled
        self.node_of = {d: n for n, devs in a.topology.nodes().items() for d in devs}

        driver = threading.Thread(target=self.drive, daemon=True, name="soak-driver")

        def before_run(job, agents):
            self.job, self.agents = job, agents
            driver.start()

        t0 = time.monotonic()
        run = run_resilient(ResilientConfig(
            spec=a.spec, plan=a.plan, topology=a.topology, state=a.state, planner=a.planner,
            detector=self.cfg.detector, iterations=self.iterations, workdir=self.work / "job",
            repair_requests=self.repairs,
            # A hang guard, not a speed limit: torch_native commits ~1 iteration/s
            # on the shared 2-core machine at load 30 (the job took >900 s there).
            timeout_s=max(2400.0, self.failures * 120.0),
            hooks=RunHooks(observe=observer(iteration=self.on_iteration,
                                            job=lambda ev: self.on_event(event_dicts([ev])[0])),
                           before_run=before_run)))
        wall = time.monotonic() - t0
        self.done.set()
        if driver.ident is not None:
            driver.join(120)  # it may be verifying: torch work must not outlive the interpreter
        if not run.ok:
            self.problems.append(f"job failed: {run.error} (logs {run.logs})")
        if len(run.records) == self.iterations:
            self.advance(upto=self.iterations - 1)  # the rest of the job, up to its last iteration
            if self.verified[0] != self.iterations - 1:
                self.problems.append(f"verified up to iteration {self.verified[0]} only, not the last "
                                     f"({self.iterations - 1})")
        for r in self.rows:  # each failure's worst step, through its recovery and through its repair
            if "recovered_at" in r:
                r["param_err"] = self.worst_between(r["iteration"], r["recovered_at"])
            if "repaired_at" in r:
                r["repair_param_err"] = self.worst_between(r["recovered_at"] + 1, r["repaired_at"])
        survived = sum(1 for r in self.rows if r.get("recovered"))
        checks = [r.get(k) for r in self.rows for k in ("param_err", "repair_param_err") if k in r]
        return dict(
            adapter=self.adapter, failures_injected=len(self.rows), failures_survived=survived,
            device_failures=sum(len(r["devices"]) for r in self.rows),
            by_kind=dict(Counter(r["kind"] for r in self.rows)),
            restores_with_fallback=sum(1 for r in self.rows if r.get("fallback")),
            false_reports_repaired=self.stray_repairs,
            lost_microbatches=self.accounting["lost"], doubled_microbatches=self.accounting["doubled"],
            iterations=len(run.records), iterations_accounted=self.accounting["iterations_checked"],
            iterations_verified=len(self.checked), verified_to=self.verified[0],
            worst_step_error=self.accounting["worst_step_error"],
            loss_checks=self.accounting["loss_checks"], loss_failures=self.accounting["loss_failures"],
            parameter_checks=len(checks), parameter_checks_passed=sum(1 for c in checks if c is not None and c <= TOL),
            worst_parameter_error=max((c for c in checks if c is not None), default=None),
            storage_faults=sum(1 for e in run.events if e["kind"] == "storage"),
            # Replicas compare state fingerprints at every commit (docs/sdc.md); nothing
            # here corrupts data, so every finding is a false one.
            sdc_findings=sum(1 for e in run.events if e["kind"] == "sdc"),
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
    ap.add_argument("--adapter", choices=sorted(ADAPTERS), default="megatron_ref",
                    help="the adapter the job runs on (default: megatron_ref)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (worker logs, checkpoints)")
    args = ap.parse_args()
    n = 10 if args.quick else args.failures
    if n < 2:
        ap.error("--failures must be >= 2")
    with tempfile.TemporaryDirectory(prefix="resihp-soak-", ignore_cleanup_errors=True) as tmp:
        if args.keep:
            tmp = tempfile.mkdtemp(prefix="resihp-soak-kept-")
        soak = Soak(n, args.seed, Path(tmp), args.adapter)
        print(f"soak ({args.adapter}): {n} failures, {soak.iterations} iterations budget, TP1 x PP2 x DP2 on 2 nodes, "
              "float64, "
              f"checkpoint every iteration (kept until verified); work folder {tmp}", flush=True)
        print("   n  kind       devices  at      recovery          plans                          "
              "         worst step error (to the recovery / to the repair)", flush=True)
        res = soak.run()
    print("\nverified, per failure:")
    for r in res["rows"]:
        print(_row_text(r))
    print()
    width = max(len(k) for k in res if k not in ("rows", "problems"))
    for k, v in res.items():
        if k not in ("rows", "problems"):
            print(f"  {k:<{width}}  {v}")
    for p in res["problems"]:
        print(f"  PROBLEM: {p}")
    print(f"\nsoak {'passed' if res['ok'] else 'FAILED'}: {res['failures_survived']}/{n} failures survived, "
          f"{res['lost_microbatches']} lost / {res['doubled_microbatches']} doubled micro-batches, "
          f"{res['iterations_verified']} iterations verified step by step (worst {res['worst_step_error']:.1e}), "
          f"{res['loss_failures']} wrong losses, {res['wall_s']} s "
          f"(load {' '.join(res['loadavg'])})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0 if res["ok"] and res["failures_survived"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
