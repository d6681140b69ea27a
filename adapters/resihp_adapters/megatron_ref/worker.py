"""Worker process of the reference backend: ``python -m resihp_adapters.megatron_ref.worker``.

Lives across plan generations. For each generation posted in the job store it rolls
back an uncommitted iteration, rebuilds communicators, moves/re-shards or restores
state, then trains iteration by iteration, committing each through the store. When a
peer dies its collectives fail; the worker drops every reference to the broken groups
*outside* the ``except`` block (a live traceback would keep gloo's sockets open and
stall other survivors) and waits for the next generation.

Environment: ``RESIHP_STORE`` (host:port of the job store), ``RESIHP_DEVICE`` (this
worker's device id), ``RESIHP_JOB`` (path of the job JSON, see :class:`JobSpec`).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from resihp_core.plan import parse_plan
from resihp_core.predictor.corpus import CorpusSpec
from resihp_core.predictor.schedules import emit_programs
from resihp_core.runtime import jobstore
from resihp_adapters.megatron_ref.adapter import MegatronRefAdapter
from resihp_adapters.megatron_ref.data import DataSpec
from resihp_adapters.megatron_ref.model import ModelConfig

__all__ = ["JobSpec", "main"]


@dataclass(frozen=True)
class JobSpec:
    """Everything a worker needs besides the plan; written once as JSON by the launcher."""

    model: dict = field(default_factory=dict)  # ModelConfig fields
    corpus: dict = field(default_factory=dict)  # CorpusSpec fields
    dp: int = 2  # data shards (replicas of the initial plan)
    num_microbatches: int = 4
    data_seed: int = 0
    lr: float = 1e-3
    timeout_s: float = 10.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    dump_dir: str | None = None  # on stop, each worker saves its shards here (tests)
    faults: list = field(default_factory=list)  # resihp_plugins.faults.Fault dicts

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls(**json.loads(text))

    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.model)

    def data_spec(self) -> DataSpec:
        cfg = self.model_config()
        return DataSpec(CorpusSpec(**self.corpus), cfg.vocab_size, self.dp, self.num_microbatches, self.data_seed)


def _wait_new_generation(store: dist.Store, seen: int) -> int:
    while True:
        g = jobstore.latest_generation(store)
        if g > seen:
            return g
        time.sleep(0.002)


class GenerationWatch:
    """Background thread on its own store connection: notices a newer generation within
    milliseconds so a worker stops mid-iteration instead of finishing doomed work."""

    def __init__(self, address: str, timeout: datetime.timedelta, poll_s: float = 0.003) -> None:
        import threading

        self.latest = -1
        self._store = jobstore.connect(address, timeout.total_seconds())
        self._poll_s = poll_s
        threading.Thread(target=self._run, daemon=True, name="resihp-generation-watch").start()

    def _run(self) -> None:
        while True:
            try:
                self.latest = jobstore.latest_generation(self._store)
            except Exception:  # noqa: BLE001 - the job store went away: the job is over
                return
            time.sleep(self._poll_s)


def _inject(faults: list[dict], device: int, iteration: int, adapter: MegatronRefAdapter,
            applied: set[int]) -> None:
    """Apply this device's faults scheduled for ``iteration`` (each once)."""
    import signal
    import subprocess

    for n, f in enumerate(faults):
        if f["device"] != device or f["iteration"] != iteration or n in applied:
            continue
        applied.add(n)
        print(f"time={time.time():.3f} event=fault_injected device={device} kind={f['kind']} iteration={iteration}",
              file=sys.stderr, flush=True)
        if f["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f["kind"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f["kind"] == "slow":
            adapter.slowdown = float(f["factor"])
        elif f["kind"] == "comm":
            adapter.comm_delay_s = float(f["delay_s"])
        elif f["kind"] == "contend":
            subprocess.Popen([sys.executable, "-c", "import os, time\nend = time.time() + 3600\n"
                              "while time.time() < end and os.getppid() != 1: pass"])


def _detector_client(device: int):
    """Heartbeats and profiles to this node's agent when the job runs with a Detector
    (``RESIHP_AGENT_ADDR`` set by the launcher); None otherwise."""
    if not os.environ.get("RESIHP_AGENT_ADDR"):
        return None
    from resihp_core.runtime.heartbeat import WorkerClient

    env = dict(os.environ)
    env.setdefault("RESIHP_RANK", str(device))
    return WorkerClient.from_env(env).start()


def run_worker(store: dist.Store, device: int, job: JobSpec, watch: GenerationWatch | None = None) -> None:
    torch.set_num_threads(1)
    adapter = MegatronRefAdapter(
        device, job.model_config(), job.data_spec(), store, lr=job.lr, timeout_s=job.timeout_s,
        checkpoint_dir=job.checkpoint_dir, checkpoint_every=job.checkpoint_every,
    )
    # Everything imported so far lives for the whole process: keep it out of the
    # collections that release broken process groups (0.4 s -> milliseconds).
    gc.freeze()
    current = [-1]
    applied: set[int] = set()
    client = _detector_client(device)
    if watch is not None:
        adapter.abort_requested = lambda: watch.latest > current[0]
    if client is not None:
        adapter.on_step = client.beat  # progress (iteration, primitive index) per step
    store.set(f"worker/{device}/pid", str(os.getpid()))
    seen = -1
    while True:
        g = _wait_new_generation(store, seen)
        seen = g
        msg = jobstore.read_plan(store, g)
        current[0] = g
        if msg.stop:
            if client is not None:
                client.close()
            if job.dump_dir and adapter.where is not None:
                torch.save({"where": adapter.where, "iteration": adapter.iteration,
                            "plan": adapter.plan.to_text(),
                            "tensors": {k: list(v) for k, v in adapter.tensors().items()}},
                           os.path.join(job.dump_dir, f"device{device}.pt"))
            return
        if device not in msg.devices:
            continue  # excluded but alive: wait to be brought back
        t0 = time.perf_counter()
        print(f"time={time.time():.3f} event=generation_entered device={device} generation={g}",
              file=sys.stderr, flush=True)
        plan = parse_plan(msg.plan)
        old = adapter.plan
        if str(device) in msg.slow:
            adapter.slowdown = float(msg.slow[str(device)])
        if adapter.iteration > msg.resume:
            adapter.rollback()  # stepped an iteration that did not commit everywhere
            adapter.iteration = msg.resume
        t1 = time.perf_counter()
        if client is not None:
            client.set_generation(g, device)  # the Detector keys workers by stable device id
        moved, failed, t2 = 0, None, t1
        try:
            adapter.rebuild_communicators(plan, g, msg.devices)
            t2 = time.perf_counter()
            if msg.restore is not None:
                adapter.load_checkpoint(iteration=msg.restore, plan=plan)
            elif old is None:
                adapter.start_fresh(plan)
            else:
                moved = adapter.move_state(old, plan, msg.devices)
        except Exception as e:  # noqa: BLE001 - a peer died during the reconfiguration itself
            failed = f"{type(e).__name__}: {e}"
        if failed is not None:
            # Outside the except block (no traceback pins the groups). The state is the
            # previous generation's (move_state restores it on failure): wait for the
            # generation the Scheduler makes of this new failure.
            store.set(f"ctl{g}/failed/{device}", failed[:500])
            print(f"time={time.time():.3f} event=reconfiguration_failed device={device} generation={g} "
                  f"reason={failed[:200]!r}", file=sys.stderr, flush=True)
            adapter.release()
            continue
        adapter.iteration = msg.resume
        programs = {(p.replica, p.stage): p for p in emit_programs(plan)}
        executors = len(plan.devices())
        t3 = time.perf_counter()
        store.set(f"ctl{g}/ready/{device}", json.dumps({
            "seconds": t3 - t0, "rebuild_s": t2 - t1, "state_s": t3 - t2, "bytes_received": moved,
        }))
        if adapter.where is None:
            continue  # a standby: wait for a plan that uses it
        program = programs[adapter.where[:2]]
        i = msg.resume
        while i < msg.iterations and jobstore.latest_generation(store) == g:
            if job.faults:
                _inject(job.faults, device, i, adapter, applied)
            adapter.snapshot()
            failed = None
            try:
                stats = adapter.run(program, i)
            except Exception as e:  # noqa: BLE001 - a peer died: any collective may raise
                failed = f"{type(e).__name__}: {e}"
            if failed is not None:
                # Outside the except block: no traceback pins the broken groups.
                store.set(f"ctl{g}/failed/{device}", failed[:500])
                print(f"time={time.time():.3f} event=generation_left device={device} generation={g} "
                      f"iteration={i} reason={failed[:200]!r}",
                      file=sys.stderr, flush=True)
                adapter.rollback()
                adapter.iteration = i
                adapter.release()
                break
            # The first iteration of a generation carries one-time costs (allocator,
            # first touch, fresh sockets): the Detector's healthy model starts after it.
            if client is not None and i > msg.resume and (prof := adapter.profile()) is not None:
                client.send_profile(prof)
            jobstore.put_report(store, g, i, device, {
                "loss": stats.loss if adapter.where[2] == 0 else 0.0,
                "computed": stats.computed if adapter.where[2] == 0 else [], "iteration_s": stats.iteration_s,
                "comm_s": stats.comm_s, "forward_s": sum(stats.forward_s.values()),
                "backward_s": sum(stats.backward_s.values()), "replica": adapter.where[0],
                "microbatches": [[o, j, stats.forward_s[(o, j)], stats.backward_s.get((o, j), 0.0)]
                                 for (o, j) in stats.forward_s],
                "stage": adapter.where[1],
            })
            if jobstore.commit(store, g, i, executors, timeout_s=job.timeout_s * 6) != jobstore.CommitResult.COMMITTED:
                adapter.rollback()
                adapter.iteration = i
                adapter.release()
                break
            i += 1


def main() -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    address = os.environ["RESIHP_STORE"]
    device = int(os.environ["RESIHP_DEVICE"])
    with open(os.environ["RESIHP_JOB"]) as f:
        job = JobSpec.from_json(f.read())
    timeout = datetime.timedelta(seconds=max(30.0, job.timeout_s * 3))
    store = jobstore.connect(address, timeout.total_seconds())
    run_worker(store, device, job, GenerationWatch(address, timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
