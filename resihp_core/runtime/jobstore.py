"""The job's control keys in the controller-hosted job store, one place for both sides.

Every connection to the job store goes through :func:`connect` (workers) and
:func:`host` (the controller): an authenticated store bound to the address the user
chose (:mod:`resihp_core.runtime.store`; docs/security.md). Workers may not write the
``plan/`` keys.

Keys (all under the job store, generation ``g``):

- ``plan/latest``: the newest generation number; ``plan/<g>``: a JSON :class:`PlanMessage`.
- ``gen<g>/...``: torch.distributed rendezvous of that generation (``PrefixStore``).
- ``ctl<g>/done<i>``: commit counter of iteration ``i``: each executor adds 1 after its
  optimizer step. ``ctl<g>/verdict<i>``: the executor whose add completes the count
  writes ``commit``, a coordinator aborting the generation writes ``abort``, both with
  an atomic compare-and-set on an absent key, so exactly one verdict exists and every
  worker and the coordinator read the same one.
- ``ctl<g>/ready/<device>``, ``ctl<g>/report/<i>/<device>``: reconfiguration done,
  per-iteration reports (loss share, accounting, timings).
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["connect", "host", "PlanMessage", "post_plan", "latest_generation", "read_plan",
           "commit", "CommitResult", "abort_generation", "put_report", "get_report"]

ENV_SECRET = "RESIHP_SECRET"  # the worker's node credential (never on a command line)
ENV_NODE = "RESIHP_NODE"
ENV_DEVICE = "RESIHP_DEVICE"


def connect(address: str, timeout_s: float) -> Any:
    """A worker's connection to the job store at ``address`` (``host:port``).

    It authenticates as ``worker:<RESIHP_NODE>:<RESIHP_DEVICE>`` with the node
    credential in ``RESIHP_SECRET`` (set by the node agent or the local launcher) and
    checks that the store knows the job secret. ``timeout_s`` bounds connecting and
    every blocking request. The result is a ``torch.distributed.Store``.
    """
    from resihp_core.runtime.store import StoreClient, worker_store_identity

    key = os.environ.get(ENV_SECRET, "")
    if not key:
        raise RuntimeError(f"no job-store credential: {ENV_SECRET} is not set")
    node = int(os.environ.get(ENV_NODE, "0"))
    device = int(os.environ.get(ENV_DEVICE, "0"))
    return StoreClient(address, key, worker_store_identity(node, device), timeout_s=timeout_s)


def host(host: str, *, secret: str | None = None, port: int = 0,
         nodes: set[int] | None = None) -> tuple[Any, str]:
    """The controller's side: serve the job store on ``host`` only; returns the store
    as seen from this process and its ``"host:port"`` address.

    ``secret`` is the job secret workers' credentials derive from (default:
    ``RESIHP_SECRET``); the returned store's ``server`` attribute is the
    :class:`~resihp_core.runtime.store.StoreServer` (close it when the job ends).
    """
    from resihp_core.runtime.store import StoreServer

    secret = secret or os.environ.get(ENV_SECRET, "")
    if not secret:
        raise ValueError(f"the job store needs the job secret (pass secret= or set {ENV_SECRET})")
    server = StoreServer(host, secret, port, nodes=nodes)
    store = server.local()
    store.server = server  # type: ignore[attr-defined]
    return store, server.address


@dataclass(frozen=True)
class PlanMessage:
    """What every worker needs to enter a generation."""

    generation: int
    plan: str  # ParallelPlan text form
    devices: list[int]  # every live worker in this generation's world (executors + standbys)
    resume: int  # first iteration to run
    iterations: int  # run until this iteration count
    restore: int | None = None  # load checkpoint of this completed iteration first
    stop: bool = False
    slow: dict[str, float] = field(default_factory=dict)  # device -> injected slowdown

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PlanMessage:
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"malformed plan message: {e}") from None


def post_plan(store: Any, msg: PlanMessage) -> None:
    store.set(f"plan/{msg.generation}", msg.to_json())
    store.set("plan/latest", str(msg.generation))


def latest_generation(store: Any) -> int:
    """Newest posted generation, -1 if none (never blocks)."""
    if not store.check(["plan/latest"]):
        return -1
    return int(store.get("plan/latest"))


def read_plan(store: Any, generation: int) -> PlanMessage:
    return PlanMessage.from_json(store.get(f"plan/{generation}"))


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


def put_report(store: Any, generation: int, iteration: int, device: int, report: dict) -> None:
    store.set(f"ctl{generation}/report/{iteration}/{device}", json.dumps(report))


def get_report(store: Any, generation: int, iteration: int, device: int) -> dict | None:
    key = f"ctl{generation}/report/{iteration}/{device}"
    if not store.check([key]):
        return None
    return json.loads(store.get(key))
