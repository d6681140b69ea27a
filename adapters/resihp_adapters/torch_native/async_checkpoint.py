"""torch_native checkpoints off the training path (docs/checkpoints.md, "Writes do not
stall training").

A DCP save is three steps: plan (a collective: every writer's plan gathered, the
global plan and the checkpoint's metadata made), write (each rank its own files) and
finish (a collective: the write results gathered, ``.metadata`` written). Here:

- the plan is made once per plan generation (it depends only on the state's names,
  shapes and sharding, which a generation keeps), in the training thread, by
  :func:`plan_writes`: every rank gathers every plan and computes the same global plan
  and metadata, so there is nothing to scatter;
- at a due iteration the training thread only copies its state into host staging
  buffers (:class:`Staging`, one foreach copy into buffers kept across checkpoints)
  and hands them to :class:`AsyncDcpWriter`, whose thread writes this rank's files;
- the finish needs no collective: each rank's thread, once its files are written
  and fsynced, puts its write results in a file next to them, and the coordinator's
  sealer waits for every rank's file, writes ``.metadata`` and then seals the
  checkpoint (:func:`resihp_core.checkpoints.seal`, the files the metadata names) and
  applies retention.

So a checkpoint is sealed only when every writer finished: a writer killed mid-write,
a full disk or a coordinator that died leave the folder without a manifest, which the
restore rule skips (:func:`resihp_core.checkpoints.restore_point`). Nothing in the
background touches a process group, so a generation change never waits for a write
and never pins a group. Data files carry the generation in their name
(``__g<generation>r<rank>_<n>.distcp``): a late writer of an earlier attempt at the same
iteration never overwrites a file of a later attempt, and the seal lists only the
files of its own write.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from resihp_core import checkpoints
from resihp_core.protocols.checkpoints import CheckpointWrite

__all__ = ["AsyncDcpWriter", "DcpPlan", "Staging", "plan_writes"]

#: a rank's write results, next to its data files until the coordinator has read them
_RESULTS = "written-g{generation}-r{rank}.pkl"


@dataclass
class DcpPlan:
    """One generation's DCP write plan, the same for each checkpoint of it."""

    generation: int
    rank: int  # in the checkpoint writers' group
    world: int
    planner: object  # DefaultSavePlanner, set up again on each write's staged state
    local_plan: object  # this rank's final SavePlan (its files' prefix included)
    metadata: object  # the checkpoint's Metadata without storage data (every rank has it)

    @property
    def coordinator(self) -> bool:
        return self.rank == 0


class Staging:
    """Host buffers for one rank's checkpoint state, reused while the state keeps its
    names, shapes and dtypes: :meth:`stage` copies the live state into them in one
    foreach copy and returns the state dict the writer reads (DTensors rebuilt around
    the buffers, so DCP still sees each shard's place in the whole)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._bufs: list[Tensor] = []

    @staticmethod
    def _signature(flat: list[tuple[tuple[str, str], object]]) -> tuple:
        from torch.distributed.tensor import DTensor

        sig = []
        for key, v in flat:
            if isinstance(v, DTensor):
                loc = v._local_tensor
                sig.append((key, "d", tuple(loc.shape), loc.dtype, tuple(v.placements), id(v.device_mesh)))
            elif isinstance(v, Tensor):
                sig.append((key, "t", tuple(v.shape), v.dtype))
        return tuple(sig)

    def stage(self, sd: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
        from torch.distributed.tensor import DTensor

        flat = [((top, k), v) for top, part in sd.items() for k, v in part.items()]
        key = self._signature(flat)
        srcs = [v._local_tensor if isinstance(v, DTensor) else v for _, v in flat if isinstance(v, Tensor)]
        if key != self._key:
            self._bufs = [torch.empty_like(s, device="cpu") for s in srcs]
            self._key = key
        with torch.no_grad():
            torch._foreach_copy_(self._bufs, [s.detach() for s in srcs])
        out: dict[str, dict[str, object]] = {top: {} for top in sd}
        bufs = iter(self._bufs)
        for (top, k), v in flat:
            if isinstance(v, DTensor):
                out[top][k] = DTensor.from_local(next(bufs), v.device_mesh, v.placements, run_check=False,
                                                 shape=v.shape, stride=v.stride())
            elif isinstance(v, Tensor):
                out[top][k] = next(bufs)
            else:
                out[top][k] = copy.deepcopy(v)  # bytes, numbers: immutable or small
        return out


def plan_writes(staged: dict, group: object | None, generation: int) -> DcpPlan:
    """The generation's write plan (collective over ``group``, the checkpoint writers):
    each rank's local plan gathered to every rank, which computes the same global plan
    and metadata; this rank's plan gets a file prefix naming the generation."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    planner = DefaultSavePlanner()
    planner.set_up_planner(staged, None, rank == 0)
    local = planner.create_local_plan()
    plans: list[object] = [None] * world
    dist.all_gather_object(plans, local, group=group)
    global_plans, metadata = planner.create_global_plan(plans)
    mine = dataclasses.replace(global_plans[rank], storage_data=_StoragePrefix(f"__g{generation}r{rank}_"))
    return DcpPlan(generation, rank, world, planner, planner.finish_plan(mine), metadata)


@dataclass
class _Job:
    iteration: int
    root: str  # the job's checkpoint folder
    folder: str  # the DCP folder inside the iteration's folder
    staged: dict
    plan: DcpPlan
    keep: int
    staged_s: float


class AsyncDcpWriter:
    """This rank's background DCP writer: one write in flight at a time (a submit while
    the previous write still runs waits for it, up to ``busy_timeout_s``, so memory
    stays bounded and every due checkpoint is written); the coordinator's sealers wait
    up to ``seal_timeout_s`` for the other writers before giving the checkpoint up
    (unsealed). Results come back through :meth:`results` as
    :class:`~resihp_core.protocols.checkpoints.CheckpointWrite` records: a storage
    error of this rank's write, or the coordinator's sealed checkpoint."""

    def __init__(self, *, busy_timeout_s: float = 120.0, seal_timeout_s: float = 120.0,
                 generation: Callable[[], int] | None = None) -> None:
        self.busy_timeout_s, self.seal_timeout_s = busy_timeout_s, seal_timeout_s
        #: the rank's current plan generation: a checkpoint of an earlier one that seals
        #: late does not apply retention (a restore may be loading the checkpoint that
        #: retention would delete); the next checkpoint of the current one does
        self.generation = generation
        #: called in the writer thread before a write starts (tests pause a writer here)
        self.before_write: Callable[[int], None] = lambda iteration: None
        self.waited_s = 0.0  # time submit spent waiting for the previous write
        self._q: queue.Queue[_Job] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._results: list[CheckpointWrite] = []
        self._sealers: list[tuple[int, threading.Thread]] = []  # (iteration, its sealer), oldest first
        threading.Thread(target=self._run, daemon=True, name="resihp-dcp-writer").start()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until this rank's write in flight (if any) finished; the staging
        buffers are free again then."""
        t0 = time.perf_counter()
        ok = self._idle.wait(self.busy_timeout_s if timeout is None else timeout)
        self.waited_s += time.perf_counter() - t0
        return ok

    def submit(self, iteration: int, root: str, folder: str, staged: dict, plan: DcpPlan, keep: int,
               staged_s: float) -> None:
        """Queue the write of ``staged`` (call :meth:`wait_idle` before staging into
        buffers a running write may still read)."""
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put(_Job(iteration, root, folder, staged, plan, keep, staged_s))

    def give_up(self, iteration: int, why: str) -> None:
        with self._lock:
            self._results.append(CheckpointWrite(iteration, why))

    def results(self) -> list[CheckpointWrite]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def drain(self, timeout: float = 120.0) -> bool:
        """Wait until every queued write is written and the newest checkpoint's seal
        finished or gave up (the job's end: the last checkpoint must be complete before
        the process goes). An older seal still waiting is for a writer that died in an
        earlier generation: the job's end does not wait for it."""
        deadline = time.monotonic() + timeout
        if not self._idle.wait(timeout):
            return False
        last = [t for _, t in self._sealers[-1:]]  # the last checkpoint this rank wrote
        for t in last:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in last)

    # ------------------------------------------------------------ the threads
    def _run(self) -> None:
        while True:
            job = self._q.get()
            t0 = time.perf_counter()
            error, nbytes = None, 0
            try:
                self.before_write(job.iteration)
                nbytes = self._write(job)
            except Exception as e:  # noqa: BLE001 - a storage error is reported, never raised
                error = f"{type(e).__name__}: {e}"
            if error is not None:
                with self._lock:
                    self._results.append(CheckpointWrite(job.iteration, error, 0, time.perf_counter() - t0))
            elif job.plan.coordinator:
                t = threading.Thread(target=self._seal, args=(job, nbytes, t0), daemon=True,
                                     name=f"resihp-dcp-seal-{job.iteration}")
                self._sealers = [(i, s) for i, s in self._sealers if s.is_alive()] + [(job.iteration, t)]
                t.start()
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def _write(self, job: _Job) -> int:
        """This rank's files, fsynced, then its write results (atomically): the
        coordinator takes the results file as this rank's "finished"."""
        from torch.distributed.checkpoint import FileSystemWriter

        p = job.plan
        os.makedirs(job.folder, exist_ok=True)
        writer = FileSystemWriter(job.folder, sync_files=True)
        writer.set_up_storage_writer(p.coordinator, rank=p.rank)
        p.planner.set_up_planner(job.staged, writer.storage_meta(), p.coordinator)
        fut = writer.write_data(p.local_plan, p.planner)
        fut.wait()
        results = fut.value()
        target = Path(job.folder) / _RESULTS.format(generation=p.generation, rank=p.rank)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            pickle.dump(results, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        return sum(r.storage_data.length for r in results)

    def _seal(self, job: _Job, nbytes: int, t0: float) -> None:
        """The coordinator: every writer's results, then ``.metadata``, the manifest
        (the seal) and retention; gives up (unsealed) past ``seal_timeout_s``."""
        from torch.distributed.checkpoint import FileSystemWriter

        p, folder = job.plan, Path(job.folder)
        names = [folder / _RESULTS.format(generation=p.generation, rank=r) for r in range(p.world)]
        deadline = time.monotonic() + self.seal_timeout_s
        while not all(n.exists() for n in names):
            if time.monotonic() > deadline:
                missing = [r for r, n in zip(range(p.world), names) if not n.exists()]
                # A peer that died (or was cut off) mid-write: not a storage fault. The
                # checkpoint stays unsealed; the restore rule skips it.
                import sys

                print(f"time={time.time():.3f} event=checkpoint_unsealed iteration={job.iteration} "
                      f"missing_writers={missing}", file=sys.stderr, flush=True)
                return
            time.sleep(0.01)
        error, results = None, []
        try:
            for n in names:
                with open(n, "rb") as f:
                    results.append(pickle.load(f))
            writer = FileSystemWriter(job.folder, sync_files=True)
            writer.set_up_storage_writer(True, rank=0)
            writer.finish(copy.copy(p.metadata), results)
            for n in names:
                n.unlink(missing_ok=True)
            rel = folder.relative_to(checkpoints.iteration_dir(job.root, job.iteration)).as_posix()
            files = [f"{rel}/.metadata"] + sorted({f"{rel}/{r.storage_data.relative_path}"
                                                  for rs in results for r in rs})
            checkpoints.seal(job.root, job.iteration, files)
            late = self.generation is not None and self.generation() != p.generation
            pruned = () if late else tuple(checkpoints.prune(job.root, job.keep))
        except Exception as e:  # noqa: BLE001 - a storage error is reported, never raised
            error, pruned = f"{type(e).__name__}: {e}", ()
        total = sum(r.storage_data.length for rs in results for r in rs) if error is None else nbytes
        with self._lock:
            self._results.append(CheckpointWrite(job.iteration, error, total,
                                                 job.staged_s + time.perf_counter() - t0, pruned))
