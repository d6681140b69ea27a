"""The job's control keys in the controller-hosted job store, one place for both sides.

Every connection to the job store goes through :func:`connect` (workers) and
:func:`host` (the controller): an authenticated store bound to the address the user
chose (:mod:`resihp_core.runtime.store`; docs/security.md). Workers may not write the
``plan/`` keys.

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
import os
from typing import Any

from resihp_core.protocol import IterationReport, PlanUpdate, ProtocolError, decode, encode

__all__ = ["connect", "host", "post_plan", "latest_generation", "read_plan",
           "commit", "CommitResult", "abort_generation", "put_report", "get_report"]


ENV_SECRET = "RESIHP_SECRET"  # the worker's node credential (never on a command line)
ENV_NODE = "RESIHP_NODE"
ENV_DEVICE = "RESIHP_DEVICE"


def host(address: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0, *,
         secret: str | None = None, nodes: set[int] | None = None) -> tuple[Any, str]:
    """Start the job store on the controller's side, bound to ``address`` only; returns
    it (as seen from this process: every key writable) and its ``host:port``.

    ``secret`` is the job secret the workers' node credentials derive from (default:
    ``RESIHP_SECRET``); ``nodes`` the node ids allowed to connect (None: any). The
    returned store's ``server`` attribute is the
    :class:`~resihp_core.runtime.store.StoreServer` (close it when the job ends).
    """
    from resihp_core.runtime.store import StoreServer

    secret = secret or os.environ.get(ENV_SECRET, "")
    if not secret:
        raise ValueError(f"the job store needs the job secret (pass secret= or set {ENV_SECRET})")
    server = StoreServer(address, secret, port, nodes=nodes)
    store = server.local(timeout_s)
    store.server = server  # type: ignore[attr-defined]
    return store, server.address


def connect(address: str, timeout_s: float = 30.0) -> Any:
    """A worker's connection to the job store at ``host:port`` (a ``torch.distributed.Store``).

    It authenticates as ``worker:<RESIHP_NODE>:<RESIHP_DEVICE>`` with the node
    credential in ``RESIHP_SECRET`` (set by the node agent or the local launcher) and
    checks that the store knows the job secret. ``timeout_s`` bounds connecting and
    every blocking request.
    """
    from resihp_core.runtime.store import StoreClient, worker_store_identity

    h, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"job store address {address!r} must be host:port")
    key = os.environ.get(ENV_SECRET, "")
    if not key:
        raise RuntimeError(f"no job-store credential: {ENV_SECRET} is not set")
    node = int(os.environ.get(ENV_NODE, "0"))
    device = int(os.environ.get(ENV_DEVICE, "0"))
    return StoreClient(address, key, worker_store_identity(node, device), timeout_s=timeout_s)


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
    try:
        # Block in the store rather than poll it: a poll per half millisecond per waiting
        # executor is real CPU in the controller's process, which serves the store.
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - torch's stores raise DistStoreError on time-out
        if not store.check([key]):
            return _verdict(store, generation, iteration, CommitResult.ABORTED)
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
