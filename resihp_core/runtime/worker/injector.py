"""Fault injection inside a worker: one object the worker owns and lends its adapter.

The worker calls :meth:`FaultInjector.at_iteration` when it starts an iteration; faults
of this device scheduled for that iteration happen then, each once (kinds: see
``resihp_core.faults``). Process-level faults (kill, stop, CPU contention) act here;
the adapter honours the three it must apply itself: :attr:`slowdown` (stretch every
compute chunk), :attr:`comm_delay_s` (delay every receive and reduction) and bit flips
(:meth:`FaultInjector.corrupt` at the optimizer step, docs/sdc.md).

Because every adapter ends each compute chunk here, the injector also carries the
worker's :class:`~resihp_core.detector.environment.CpuWaitMeter` (:attr:`cpu_wait`):
the time the chunk waited for a CPU is taken before an injected slowdown sleeps, so a
slow device never shows as waiting and contention always does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from resihp_core.detector.environment import CpuWaitMeter

if TYPE_CHECKING:
    import torch

__all__ = ["FaultInjector"]

_BUSY = "import os, time\nend = time.time() + 3600\nwhile time.time() < end and os.getppid() != 1: pass"


def _device_exception(kind: str) -> Exception:
    """What a GPU job sees of a failing device: CUDA's sticky error for an uncorrectable
    ECC error (``torch.AcceleratorError`` where torch has it), or NCCL's error through
    torch.distributed (``DistBackendError``)."""
    import torch

    if kind == "ecc":
        cls = getattr(torch, "AcceleratorError", RuntimeError)
        text = "CUDA error: uncorrectable ECC error encountered"
        try:
            return cls(text)
        except TypeError:  # a constructor that wants the error code first
            return RuntimeError(text)
    return torch.distributed.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp, unhandled system error (run with NCCL_DEBUG=INFO for details), "
        "NCCL version 2.28.9 ncclSystemError: System call (e.g. socket, malloc) or external library call failed")


class FaultInjector:
    """This device's scheduled faults and the slowdowns currently in force."""

    def __init__(self, device: int, faults: Iterable[dict[str, Any]] = ()) -> None:
        self.device = device
        self.faults = [f for f in faults if int(f["device"]) == device]
        self.slowdown = 1.0  # >1: compute chunks take this many times longer
        self.comm_delay_s = 0.0  # added to every receive and reduction
        self._applied: set[int] = set()
        self._busy: list[subprocess.Popen] = []
        self._flips: list[dict[str, Any]] = []  # armed for the current iteration (``repeat``: kept)
        self.flipped = 0  # bits flipped so far
        self.cpu_wait = CpuWaitMeter()

    def at_iteration(self, iteration: int) -> None:
        self.cpu_wait.start_iteration()
        self._flips = [f for f in self._flips if f.get("repeat")]
        for n, f in enumerate(self.faults):
            if f["iteration"] != iteration or n in self._applied:
                continue
            self._applied.add(n)
            print(f"time={time.time():.3f} event=fault_injected device={self.device} kind={f['kind']} "
                  f"iteration={iteration}", file=sys.stderr, flush=True)
            kind = f["kind"]
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "ecc":
                raise _device_exception("ecc")
            elif kind == "nccl":
                raise _device_exception("nccl")
            elif kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "slow":
                self.slowdown = float(f["factor"])
            elif kind == "comm":
                self.comm_delay_s = float(f["delay_s"])
            elif kind == "contend":  # dies with this worker (it polls its parent)
                self._busy.append(subprocess.Popen([sys.executable, "-c", _BUSY]))
            elif kind == "flip":
                self._flips.append(f)

    def flip_due(self, target: str) -> bool:
        """Whether a flip of ``target`` is armed now (an adapter gathers the tensors
        for :meth:`corrupt` only then)."""
        return any(f.get("target", "grad") == target for f in self._flips)

    def corrupt(self, target: str, named: Mapping[str, torch.Tensor]) -> None:
        """Flip the bits armed for ``target`` (``grad``, ``param``, ``optimizer``) in
        ``named`` tensors: bit ``bit`` (modulo the element's width) of the first element
        of the first tensor by name. An adapter calls this at its optimizer step; a flip
        not due does nothing. A ``repeat`` flip stays armed for every later iteration."""
        due = [f for f in self._flips if f.get("target", "grad") == target]
        if not due or not named:
            return
        import torch

        name = min(n for n, t in named.items() if t is not None and t.numel())
        flat = named[name].detach().view(-1)
        ints = flat.view(getattr(torch, {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}[flat.element_size()]))
        for f in due:
            width = 8 * flat.element_size()
            bit = int(f.get("bit", 20)) % width
            mask = 1 << bit
            if mask >= 1 << (width - 1) and ints.dtype != torch.uint8:
                mask -= 1 << width  # the sign bit, as the signed integer it is
            with torch.no_grad():
                ints[0:1].bitwise_xor_(mask)
            self.flipped += 1
            print(f"time={time.time():.3f} event=bit_flipped device={self.device} target={target} tensor={name} "
                  f"bit={bit}", file=sys.stderr, flush=True)
        self._flips = [f for f in self._flips if f not in due or f.get("repeat")]

    def stretch(self, seconds: float) -> float:
        """Under an injected slowdown, sleep so a compute chunk that took ``seconds``
        takes ``slowdown`` times as long; returns the stretched duration. Ends the
        chunk for :attr:`cpu_wait` first."""
        self.cpu_wait.end_chunk()
        if self.slowdown > 1.0:
            time.sleep(seconds * (self.slowdown - 1.0))
            return seconds * self.slowdown
        return seconds

    def delay_comm(self) -> None:
        if self.comm_delay_s:
            time.sleep(self.comm_delay_s)
