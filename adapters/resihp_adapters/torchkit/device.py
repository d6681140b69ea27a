"""Where one worker's tensors live and which collective backend carries them.

Every torch adapter asks :func:`placement_for` once per worker, from ``runtime.backend``
(``docs/gpu.md``):

* ``"gloo"``: CPU tensors, gloo (what every CPU test runs);
* ``"nccl"``: ``cuda:<local rank>``, NCCL for CUDA tensors (CPU tensors of the same
  groups still go over gloo: the default group is made with ``"cpu:gloo,cuda:nccl"``).
  Without CUDA, or with fewer GPUs than workers on a node, it is a configuration error
  naming ``runtime.backend``;
* ``"auto"`` (the default): NCCL on ``cuda:<local rank>`` when every worker of the node
  has its own GPU; when several share one (NCCL refuses two ranks on one device) an
  adapter whose transfers are all its own (``own_transfers``) computes on the shared
  GPU and stages each transfer through host memory over gloo, and one whose transfers
  are torch's or DeepSpeed's (they send CUDA tensors, which gloo cannot) stays on the
  CPU; no CUDA: CPU and gloo.

On a failure NCCL communicators are aborted (:func:`release_world`, :class:`AbortWatch`),
since a survivor's pending NCCL collective would otherwise wait for a peer that is gone;
chunk timings use CUDA events on a GPU (:class:`ChunkTimer`): host time would measure
kernel launches, not the device time the predictor's cost model fits.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from resihp_core.config import ConfigError

__all__ = ["BACKENDS", "Placement", "ChunkTimer", "AbortWatch", "placement_for", "choose", "release_world",
           "abort_if_nccl", "CPU"]

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Placement:
    """A worker's compute device and the backend that carries its CUDA tensors.

    ``backend`` is ``"nccl"`` or ``"gloo"``; ``reason`` says why (logs, ``gpu_check``)."""

    device: torch.device
    backend: str
    reason: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def init_backend(self) -> str:
        """What ``init_process_group`` gets: with NCCL, CPU tensors keep gloo (state
        transfers and control messages that are built on the host)."""
        return "cpu:gloo,cuda:nccl" if self.backend == "nccl" else "gloo"

    @property
    def wire(self) -> torch.device:
        """Where a tensor must be to travel: the GPU under NCCL, the host under gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def to_wire(self, t: Tensor) -> Tensor:
        return t if t.device == self.wire else t.to(self.wire)

    def to_home(self, t: Tensor) -> Tensor:
        return t if t.device == self.device else t.to(self.device)

    def activate(self) -> None:
        """Make this worker's GPU the current one (NCCL and CUDA events use it)."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)
            if self.backend == "nccl":
                # torch's own watchdog must not abort or kill on its own: ResiHP aborts
                # the communicators itself when the generation is superseded (docs/gpu.md).
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")

    def timer(self) -> ChunkTimer:
        return ChunkTimer(self.device)


CPU = Placement(torch.device("cpu"), "gloo", "runtime.backend = 'gloo'")


def choose(backend: str, *, local_rank: int, local_world: int, own_transfers: bool,
           cuda_available: bool, gpu_count: int) -> Placement:
    """The placement rule of the module docstring, given what this worker sees."""
    if backend not in BACKENDS:
        raise ConfigError(f"must be one of {', '.join(BACKENDS)}", path="runtime.backend", value=backend)
    if backend == "gloo":
        return CPU
    if not cuda_available or gpu_count < 1:
        if backend == "nccl":
            build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device visible"
            raise ConfigError(f"NCCL needs CUDA, but this worker's torch {torch.__version__} sees none ({build}); "
                              "use 'auto' or 'gloo'", path="runtime.backend", value=backend)
        return Placement(torch.device("cpu"), "gloo", "auto: no CUDA device")
    if local_world <= gpu_count:
        return Placement(torch.device("cuda", local_rank % gpu_count), "nccl", f"{backend}: one GPU per worker")
    if backend == "nccl":
        raise ConfigError(f"NCCL needs one GPU per worker, but {local_world} workers share {gpu_count} GPU(s) on "
                          "this node (NCCL refuses two ranks on one device); use 'auto' (shares them over gloo)",
                          path="runtime.backend", value=backend)
    if own_transfers:
        return Placement(torch.device("cuda", local_rank % gpu_count), "gloo",
                         f"auto: {local_world} workers share {gpu_count} GPU(s), transfers staged through the host")
    return Placement(torch.device("cpu"), "gloo",
                     f"auto: {local_world} workers share {gpu_count} GPU(s) and this adapter's collectives "
                     "send CUDA tensors, which gloo cannot: CPU")


def placement_for(device: int, section: Mapping[str, object], *, own_transfers: bool,
                  env: Mapping[str, str] | None = None) -> Placement:
    """This worker's placement from its adapter section (``backend``,
    ``devices_per_node``: devices are numbered node-major, so the local rank is
    ``device % devices_per_node``); without ``devices_per_node``, ``LOCAL_RANK`` /
    ``LOCAL_WORLD_SIZE`` of the environment, else one worker per GPU is assumed."""
    env = os.environ if env is None else env
    backend = str(section.get("backend", "auto"))
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    per_node = section.get("devices_per_node")
    if isinstance(per_node, int) and per_node > 0:
        local, world = device % per_node, per_node
    elif env.get("LOCAL_RANK") and env.get("LOCAL_WORLD_SIZE"):
        local, world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    else:
        local, world = (device % count if count else 0), 1
    placement = choose(backend, local_rank=local, local_world=world, own_transfers=own_transfers,
                       cuda_available=cuda, gpu_count=count)
    placement.activate()
    return placement


class ChunkTimer:
    """Times one compute chunk: CUDA events on a GPU (device time; :meth:`stop` waits for
    the chunk's kernels), ``perf_counter`` on the host."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        self._start: torch.cuda.Event | None = None

    def start(self) -> ChunkTimer:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        """Seconds since :meth:`start`."""
        if self.cuda and self._start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self._start.elapsed_time(end) / 1000.0
        return time.perf_counter() - self._t0


def _abort_available() -> bool:
    return hasattr(dist.distributed_c10d, "_abort_process_group")


def abort_if_nccl(placement: Placement) -> bool:
    """Abort every communicator of this process when they are NCCL ones (a pending
    collective with a dead peer never returns otherwise); True if it did."""
    if placement.backend == "nccl" and _abort_available() and dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
        return True
    return False


def release_world(placement: Placement) -> None:
    """End every process group of this process: NCCL communicators are aborted (a
    destroy would wait for pending work with a dead peer), gloo ones destroyed; then the
    group counter is reset and the groups collected (gloo closes sockets only when the
    last reference goes)."""
    if dist.is_initialized():
        try:
            if not abort_if_nccl(placement):
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group still has to go
            pass
    # Group names come from a process-wide counter that only a successful destroy resets:
    # after an init_process_group that failed in its rendezvous (a peer died) the next
    # generation's groups would get other names than its peers' and never meet.
    dist.distributed_c10d._world.group_count = 0
    gc.collect()


class AbortWatch:
    """Under NCCL, a thread that aborts this process's communicators as soon as the
    generation is superseded (a peer died or the plan changed): the training thread may
    be blocked on a collective whose peer is gone, which no NCCL call returns from on its
    own. Under gloo nothing is started (peers' closed sockets end pending work)."""

    def __init__(self, placement: Placement, superseded: Callable[[], bool], interval_s: float = 0.05,
                 grace_s: float = 0.0) -> None:
        self.placement, self.superseded, self.interval_s = placement, superseded, interval_s
        # Superseded for this long before aborting: a worker that is not blocked stops
        # the watch itself first and keeps its communicators to derive the next from.
        self.grace_s = grace_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.aborted = False
        self._thread: threading.Thread | None = None

    @property
    def needed(self) -> bool:
        return self.placement.backend == "nccl" and _abort_available()

    def start(self) -> AbortWatch:
        if self.needed:
            self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-nccl-abort")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                gone = self.superseded()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                gone = True
            if gone:
                if self.grace_s > 0 and self._stop.wait(self.grace_s):
                    return
                with self._lock:
                    if not self._stop.is_set() and dist.is_initialized():
                        dist.distributed_c10d._abort_process_group()
                        self.aborted = True
                return

    def stop(self) -> bool:
        """Before the training thread touches the groups itself (release, rebuild); True
        if the watch aborted the communicators (nothing can be derived from them)."""
        with self._lock:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        return self.aborted
