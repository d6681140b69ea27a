"""The job's control keys in the controller-hosted job store, one place for both sides.

The whole worker protocol (keys, commit/abort, ``RESIHP_*`` variables) is written down
in ``docs/worker-protocol.md``. Keys (generation ``g``):

- ``plan/latest``: the newest generation number; ``plan/<g>``: the generation's
  :class:`~resihp_core.protocol.PlanUpdate`, msgpack-encoded (the typed wire message,
  validated when read).
- ``gen<g>/...``: torch.distributed rendezvous of that generation (``PrefixStore``).
- ``ctl<g>/done<i>``: commit counter of iteration ``i``: each executor adds 1 after its
  optimizer step. ``ctl<g>/verdict<i>``: the executor whose add completes the count
  writes ``commit``, a coordinator aborting the generation writes ``abort``, both with
  an atomic compare-and-set on an absent key, so exactly one verdict exists and every
  worker and the coordinator read the same one.
- ``ctl<g>/ready/<device>``: reconfiguration done (JSON timings);
  ``ctl<g>/failed/<device>``: why this worker left the generation;
  ``ctl<g>/report/<i>/<device>``: the :class:`~resihp_core.protocol.IterationReport`.
- ``worker/<device>/pid``: the worker's process id.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from resihp_core.protocol import IterationReport, PlanUpdate, ProtocolError, decode, encode

__all__ = ["connect", "host", "post_plan", "latest_generation", "read_plan",
           "commit", "CommitResult", "abort_generation", "put_report", "get_report"]


def host(address: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> tuple[Any, str]:
    """Start the job store on the controller's side; returns it and its ``host:port``."""
    import torch.distributed as dist

    store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{address}:{store.port}"


def connect(address: str, timeout_s: float = 30.0) -> Any:
    """A worker's connection to the job store at ``host:port``."""
    import torch.distributed as dist

    h, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"job store address {address!r} must be host:port")
    return dist.TCPStore(h, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def post_plan(store: Any, msg: PlanUpdate) -> None:
    store.set(f"plan/{msg.generation}", encode(msg))
    store.set("plan/latest", str(msg.generation))


def latest_generation(store: Any) -> int:
    """Newest posted generation, -1 if none (never blocks)."""
    if not store.check(["plan/latest"]):
        return -1
    return int(store.get("plan/latest"))


def read_plan(store: Any, generation: int) -> PlanUpdate:
    """Generation ``generation``'s plan message; ``ValueError`` if it is malformed."""
    try:
        msg = decode(store.get(f"plan/{generation}"))
    except ProtocolError as e:
        raise ValueError(f"malformed plan message of generation {generation}: {e}") from None
    if not isinstance(msg, PlanUpdate) or msg.generation != generation:
        raise ValueError(f"plan/{generation} does not hold generation {generation}'s plan")
    return msg


class CommitResult:
    COMMITTED = "commit"
    ABORTED = "abort"


def _verdict(store: Any, generation: int, iteration: int, proposal: str) -> str:
    got = store.compare_set(f"ctl{generation}/verdict{iteration}", "", proposal)
    return got.decode() if isinstance(got, bytes) else str(got)


def commit(store: Any, generation: int, iteration: int, executors: int,
           poll_s: float = 0.0005, timeout_s: float = 600.0) -> str:
    """Add this executor to the iteration's commit counter and wait for the verdict."""
    if store.add(f"ctl{generation}/done{iteration}", 1) == executors:
        return _verdict(store, generation, iteration, CommitResult.COMMITTED)
    key = f"ctl{generation}/verdict{iteration}"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            return _verdict(store, generation, iteration, CommitResult.ABORTED)
        time.sleep(poll_s)
    got = store.get(key)
    return got.decode() if isinstance(got, bytes) else str(got)


def abort_generation(store: Any, generation: int, first: int) -> int:
    """Abort ``generation`` at its first uncommitted iteration (from ``first`` on);
    returns that iteration: every iteration before it committed everywhere."""
    i = first
    while _verdict(store, generation, i, CommitResult.ABORTED) == CommitResult.COMMITTED:
        i += 1
    return i


def put_report(store: Any, report: IterationReport) -> None:
    store.set(f"ctl{report.generation}/report/{report.iteration}/{report.device}", encode(report))


def get_report(store: Any, generation: int, iteration: int, device: int) -> IterationReport | None:
    key = f"ctl{generation}/report/{iteration}/{device}"
    if not store.check([key]):
        return None
    msg = decode(store.get(key))
    if not isinstance(msg, IterationReport):
        raise ValueError(f"{key} holds a {type(msg).__name__}, not an iteration report")
    return msg
