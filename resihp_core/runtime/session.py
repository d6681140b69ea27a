"""The job session: the one owner of a job's shared state (docs/design.md, "The job session").

Everything the controller, the node agents and the workers share about a job lives in
its job store, and this module is the only one that spells the store's keys. Two faces:

- **store accessors** (module functions over any :class:`KeyValueStore`), used by both
  sides: the worker posts its pid, readiness, iteration reports, why it left, storage
  faults and its commit; the controller posts plans and verdicts;
- :class:`JobSession`, the controller's side: the single generation counter, the
  commit/abort verdicts as the controller sees them, the records of what workers
  reported, and the only place observers (plugins) are notified -- each failure once,
  each plan change once, each committed iteration once -- and events are logged.

Connections go through :func:`connect` (workers) and :func:`host` (the controller): an
authenticated store bound to the address the user chose (:mod:`resihp_core.runtime.store`;
docs/security.md). Workers may not write the ``plan/`` or ``controller/`` keys.

The whole worker protocol (keys, commit/abort, ``RESIHP_*`` variables) is written down
in ``docs/worker-protocol.md``. Keys (generation ``g``):

- ``plan/latest``: the newest generation number; ``plan/<g>``: the generation's
  :class:`~resihp_core.protocol.PlanUpdate`, msgpack-encoded (the typed wire message,
  validated when read).
- ``gen<g>/...``: torch.distributed rendezvous of that generation (a ``PrefixStore``
  made by :func:`rendezvous_store`). Workers reach it through :func:`generation_fenced`:
  a wait on a ``gen<g>/`` key ends as soon as a newer generation is posted, so no
  worker lingers in a superseded rendezvous while its peers meet in the new one.
- ``ctl<g>/done<i>``: commit counter of iteration ``i``: each executor adds 1 after its
  optimizer step. ``ctl<g>/verdict<i>``: the executor whose add completes the count
  writes ``commit``, a coordinator aborting the generation writes ``abort``, both with
  an atomic compare-and-set on an absent key, so exactly one verdict exists and every
  worker and the coordinator read the same one.
- ``ctl<g>/ready/<device>``: reconfiguration done (JSON timings);
  ``ctl<g>/failed/<device>``: why this worker left the generation (a
  :class:`~resihp_core.protocol.WorkerLeft`; its ``state_lost`` flag is the typed
  "restore from a checkpoint" signal);
  ``ctl<g>/report/<i>/<device>``: the :class:`~resihp_core.protocol.IterationReport`.
- ``ctl<g>/fp/<i>/<device>``: the device's state fingerprint after iteration ``i``'s
  optimizer step (JSON: group, digest); ``ctl<g>/sdc/<i>``: why ``i`` was aborted for
  silent data corruption (JSON; docs/sdc.md).
- ``worker/<device>/pid``: the worker's process id.
- ``ckpt/faults``: count of failed checkpoint writes; ``ckpt/fault/<n>``: the n-th
  (JSON: device, iteration, error): storage faults, reported, never fatal.
- ``controller/present``: set by the controller once it steers the job, dropped by a
  store host (its own process, docs/failover.md) when the controller's connection
  closes; a worker started with ``RESIHP_CONTROLLER_GRACE`` holds each commit until
  it exists. ``controller/shutdown``: the controller ends the store host.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Literal, Mapping, Protocol, Sequence

import msgspec

from resihp_core.protocols.events import JobEvent
from resihp_core.protocols.store import KeyValueStore, WatchableStore
from resihp_core.protocol import (FailureReport, IterationReport, JobError, PlanUpdate, ProtocolError, ScriptEnded,
                                  WorkerLeft, decode, encode)

if TYPE_CHECKING:
    import torch.distributed as dist

    from resihp_core.plan import ParallelPlan
    from resihp_core.protocols.metrics import IterationMetrics
    from resihp_core.runtime.store import LocalStore, StoreClient

__all__ = ["KeyValueStore", "WatchableStore", "Observers", "JobSession", "StorageFault", "Layout",
           "connect", "host", "post_plan", "wait_controller", "PRESENT_KEY", "SHUTDOWN_KEY", "ENV_GRACE",
           "WATCH_IDENTITY", "GENERATION_NOTICE",
           "latest_generation", "wait_generation", "read_plan", "plan_bytes", "verdict", "wait_news",
           "commit", "CommitResult", "abort_generation", "put_report", "get_report", "get_reports", "put_left", "get_left",
           "put_ready", "get_ready", "put_fingerprint", "get_fingerprints", "put_sdc_finding",
           "get_sdc_finding", "put_pid", "clear_pid", "pids_posted", "put_storage_fault", "storage_faults",
           "rendezvous_store", "join_members", "generation_fenced", "rendezvous_generation", "Superseded"]

logger = logging.getLogger("resihp.session")

ENV_SECRET = "RESIHP_SECRET"  # the worker's node credential (never on a command line)
ENV_NODE = "RESIHP_NODE"
ENV_DEVICE = "RESIHP_DEVICE"
ENV_GRACE = "RESIHP_CONTROLLER_GRACE"
#: identity prefix of a worker's generation-watch connection to its node agent
#: (``generation:<device>:<rank>:<pid>``), and the ``Ack.what`` of the agent's notices on it
WATCH_IDENTITY = "generation:"
GENERATION_NOTICE = "generation"


# ------------------------------------------------------------------ the one spelling of each key
PLAN_PREFIX = "plan/"  # only the controller writes keys under these two (the store enforces it)
CONTROLLER_PREFIX = "controller/"
PLAN_LATEST = PLAN_PREFIX + "latest"
PRESENT_KEY = CONTROLLER_PREFIX + "present"
SHUTDOWN_KEY = CONTROLLER_PREFIX + "shutdown"
_FAULTS = "ckpt/faults"
_JOB_ERRORS = "joberror/count"


def _plan(g: int) -> str:
    return f"{PLAN_PREFIX}{g}"


def _rendezvous(g: int) -> str:
    return f"gen{g}/"


def _done(g: int, i: int) -> str:
    return f"ctl{g}/done{i}"


def _verdict_key(g: int, i: int) -> str:
    return f"ctl{g}/verdict{i}"


def _ready(g: int, d: int) -> str:
    return f"ctl{g}/ready/{d}"


def _failed(g: int, d: int) -> str:
    return f"ctl{g}/failed/{d}"


def _report(g: int, i: int, d: int) -> str:
    return f"ctl{g}/report/{i}/{d}"


def _fingerprint(g: int, i: int, d: int) -> str:
    return f"ctl{g}/fp/{i}/{d}"


def _sdc(g: int, i: int) -> str:
    return f"ctl{g}/sdc/{i}"


def _pid(d: int) -> str:
    return f"worker/{d}/pid"


def _fault(n: int) -> str:
    return f"ckpt/fault/{n}"


def _joined(rank: int) -> str:  # inside a generation's rendezvous_store
    return f"joined/{rank}"


# ------------------------------------------------------------------ connections
def host(address: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0, *,
         secret: str | None = None, nodes: set[int] | None = None) -> tuple[LocalStore, str]:
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


def connect(address: str, timeout_s: float = 30.0) -> StoreClient:
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


# ------------------------------------------------------------------ plans
class LazyConnection:
    """A store connection opened at its first use: a worker that commits through its
    node agent touches its commit thread's own connection only when it must commit to
    the store itself, so most workers never open it (one store thread fewer each)."""

    def __init__(self, connect: Callable[[], KeyValueStore]) -> None:
        self._connect = connect
        self._store: KeyValueStore | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(name)
        with self._lock:
            if self._store is None:
                self._store = self._connect()
        return getattr(self._store, name)


def post_plan(store: KeyValueStore, msg: PlanUpdate) -> None:
    store.set(_plan(msg.generation), encode(msg))
    store.set(PLAN_LATEST, str(msg.generation))


def latest_generation(store: KeyValueStore) -> int:
    """Newest posted generation, -1 if none (never blocks)."""
    if not store.check([PLAN_LATEST]):
        return -1
    return int(store.get(PLAN_LATEST))


def wait_generation(store: KeyValueStore, after: int, timeout_s: float) -> int:
    """Block up to ``timeout_s`` until a generation newer than ``after`` is posted;
    returns the newest one (``after`` if none came). It blocks inside the store (on
    ``plan/<after+1>``, which is written before ``plan/latest``) instead of polling it,
    so an idle worker costs the controller nothing."""
    g = latest_generation(store)
    if g > after:
        return g
    try:
        store.wait([_plan(after + 1)], datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - torch's stores raise DistStoreError on time-out
        return max(after, latest_generation(store))
    return max(after + 1, latest_generation(store))


def wait_posted(store: KeyValueStore, generation: int, timeout_s: float) -> bool:
    """Block up to ``timeout_s`` in the store until ``generation``'s plan is posted (one
    request however long it waits); False if it was not."""
    try:
        store.wait([_plan(generation)], datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - torch's stores raise DistStoreError on time-out
        return bool(store.check([_plan(generation)]))
    return True


def plan_bytes(store: KeyValueStore, generation: int) -> bytes:
    """Generation ``generation``'s plan message as stored, undecoded (a node agent relays
    it to its workers, who decode and check it)."""
    return store.get(_plan(generation))


def read_plan(store: KeyValueStore, generation: int) -> PlanUpdate:
    """Generation ``generation``'s plan message; ``ValueError`` if it is malformed."""
    try:
        msg = decode(store.get(_plan(generation)))
    except ProtocolError as e:
        raise ValueError(f"malformed plan message of generation {generation}: {e}") from None
    if not isinstance(msg, PlanUpdate) or msg.generation != generation:
        raise ValueError(f"the plan key of generation {generation} does not hold its plan")
    return msg


# ------------------------------------------------------------------ commit / abort verdicts
class CommitResult:
    COMMITTED = "commit"
    ABORTED = "abort"


def _decide(store: KeyValueStore, generation: int, iteration: int, proposal: str) -> str:
    got = store.compare_set(_verdict_key(generation, iteration), "", proposal)
    return got.decode() if isinstance(got, bytes) else str(got)


def verdict(store: KeyValueStore, generation: int, iteration: int) -> str | None:
    """The verdict of ``iteration`` in ``generation`` (``commit``/``abort``), None if
    there is none yet (never blocks)."""
    key = _verdict_key(generation, iteration)
    if not store.check([key]):
        return None
    got = store.get(key)
    return got.decode() if isinstance(got, bytes) else str(got)


def wait_news(store: WatchableStore, generation: int, iteration: int, devices: Iterable[int],
              told: Collection[int], timeout_s: float) -> tuple[Literal["verdict", "left"], int] | None:
    """Block up to ``timeout_s`` inside the store until ``iteration``'s verdict in
    ``generation`` exists or a device of ``devices`` not in ``told`` posted why it left
    the generation: ``("verdict", iteration)`` or ``("left", device)``; None if neither
    came. The controller sleeps on this instead of polling the store (its idle CPU)."""
    devs = [d for d in devices if d not in told]
    n = store.wait_any([_verdict_key(generation, iteration)] + [_failed(generation, d) for d in devs], timeout_s)
    if n < 0:
        return None
    return ("verdict", iteration) if n == 0 else ("left", devs[n - 1])


def wait_controller(store: KeyValueStore, timeout_s: float) -> bool:
    """Block until a controller is connected to the (separately hosted) store; False
    if none came within ``timeout_s``."""
    try:
        store.wait([PRESENT_KEY], datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - torch's stores raise DistStoreError on time-out
        return bool(store.check([PRESENT_KEY]))
    return True


def commit(store: KeyValueStore, generation: int, iteration: int, executors: int,
           poll_s: float = 0.0005, timeout_s: float = 600.0, hold_s: float = 0.0,
           check: Callable[[], bool] | None = None) -> str:
    """Add this executor to the iteration's commit counter and wait for the verdict.

    ``hold_s > 0``: the store is hosted outside the controller (docs/failover.md);
    while no controller is connected the iteration is held, not committed, for up to
    ``hold_s`` seconds, then aborted. ``check``: run by the executor whose add completes
    the count, before it decides; False makes the verdict ``abort`` (the cross-replica
    fingerprints, docs/sdc.md)."""
    if hold_s > 0 and not wait_controller(store, hold_s):
        return _decide(store, generation, iteration, CommitResult.ABORTED)
    if store.add(_done(generation, iteration), 1) == executors:
        return decide(store, generation, iteration, check)
    return await_verdict(store, generation, iteration, timeout_s)


def add_commits(store: KeyValueStore, generation: int, iteration: int, reports: Sequence[IterationReport]) -> int:
    """Post ``reports`` (executors of one node) and add them to the iteration's commit
    counter, in one store round trip where the store can; the count after the add. The
    counter sums, so a node's executors may arrive in one batch or several."""
    keys = [_report(r.generation, r.iteration, r.device) for r in reports]
    values = [encode(r) for r in reports]
    set_and_add = getattr(store, "set_and_add", None)  # ResiHP's store: one request
    if set_and_add is not None:
        return int(set_and_add(keys, values, _done(generation, iteration), len(reports)))
    for k, v in zip(keys, values):
        store.set(k, v)
    return int(store.add(_done(generation, iteration), len(reports)))


#: :func:`commit_batch`'s answer to the batch whose add completed the count when the
#: store was not to decide: its executor with a check runs it and calls :func:`decide`.
DECIDE = "decide"


def commit_batch(store: KeyValueStore, generation: int, iteration: int, reports: Sequence[IterationReport],
                 executors: int, *, may_decide: bool, timeout_s: float,
                 fingerprints: Mapping[int, str] | None = None) -> str:
    """Post ``reports`` (executors of one node) and their devices' SDC ``fingerprints``,
    add them to the iteration's count and wait for the verdict: in one store round trip
    where the store can (``add_and_await``; the keys are set before the add, so the
    executor that checks finds every fingerprint of a completed count). The add that
    completes the count commits when ``may_decide`` (no executor of the node has a
    check to run); otherwise that batch gets :data:`DECIDE`. A verdict that does not
    come within ``timeout_s`` is written ``abort`` (the first verdict stands)."""
    fps = sorted((fingerprints or {}).items())
    add_and_await = getattr(store, "add_and_await", None)  # ResiHP's store: one request
    if add_and_await is None:
        for d, text in fps:
            put_fingerprint(store, generation, iteration, d, text)
        count = add_commits(store, generation, iteration, reports)
        if count == executors:
            return decide(store, generation, iteration) if may_decide else DECIDE
        return await_verdict(store, generation, iteration, timeout_s)
    count, got = add_and_await([_report(r.generation, r.iteration, r.device) for r in reports]
                               + [_fingerprint(generation, iteration, d) for d, _ in fps],
                               [encode(r) for r in reports] + [text.encode() for _, text in fps],
                               _done(generation, iteration), len(reports),
                               executors, _verdict_key(generation, iteration), may_decide, timeout_s)
    if got is not None:
        return got.decode() if isinstance(got, bytes) else str(got)
    if count == executors:
        return DECIDE
    return _decide(store, generation, iteration, CommitResult.ABORTED)


def decide(store: KeyValueStore, generation: int, iteration: int, check: Callable[[], bool] | None = None) -> str:
    """The executor whose add completed the count: commit, unless ``check`` says no (or
    the controller aborted first: the first verdict stands)."""
    ok = check is None or check()
    return _decide(store, generation, iteration, CommitResult.COMMITTED if ok else CommitResult.ABORTED)


def await_verdict(store: KeyValueStore, generation: int, iteration: int, timeout_s: float) -> str:
    """Block in the store until the iteration's verdict exists and return it; abort it
    after ``timeout_s`` (the first verdict stands, so a late commit is read back)."""
    key = _verdict_key(generation, iteration)
    get_within = getattr(store, "get_within", None)  # ResiHP's store: wait and read in one round trip
    try:
        # Block in the store rather than poll it: a poll per half millisecond per waiting
        # executor is real CPU in the controller's process, which serves the store.
        if get_within is not None:
            got = get_within(key, timeout_s)
        else:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
            got = store.get(key)
    except Exception:  # noqa: BLE001 - torch's stores raise DistStoreError on time-out
        if not store.check([key]):
            return _decide(store, generation, iteration, CommitResult.ABORTED)
        got = store.get(key)
    return got.decode() if isinstance(got, bytes) else str(got)


def abort_generation(store: KeyValueStore, generation: int, first: int) -> int:
    """Abort ``generation`` at its first uncommitted iteration (from ``first`` on);
    returns that iteration: every iteration before it committed everywhere."""
    i = first
    while _decide(store, generation, i, CommitResult.ABORTED) == CommitResult.COMMITTED:
        i += 1
    return i


# ------------------------------------------------------------------ what workers report
def put_report(store: KeyValueStore, report: IterationReport) -> None:
    store.set(_report(report.generation, report.iteration, report.device), encode(report))


def get_report(store: KeyValueStore, generation: int, iteration: int, device: int) -> IterationReport | None:
    key = _report(generation, iteration, device)
    if not store.check([key]):
        return None
    msg = decode(store.get(key))
    if not isinstance(msg, IterationReport):
        raise ValueError(f"{key} holds a {type(msg).__name__}, not an iteration report")
    return msg


def get_reports(store: KeyValueStore, generation: int, iteration: int,
                devices: Iterable[int]) -> dict[int, IterationReport]:
    """The reports ``devices`` posted for ``iteration`` (absent ones left out): two
    round trips when all were posted (one check, one multi-get), as
    :func:`get_fingerprints`, else one or two per device."""
    devices = list(devices)
    keys = [_report(generation, iteration, d) for d in devices]
    multi_get = getattr(store, "multi_get", None)
    got_all = None
    if keys and multi_get is not None and store.check(keys):
        try:
            got_all = multi_get(keys)
        except TypeError:  # a store whose multi_get wants a timeout as well
            got_all = None
    if got_all is None:
        return {d: r for d in devices if (r := get_report(store, generation, iteration, d)) is not None}
    out: dict[int, IterationReport] = {}
    for d, k, raw in zip(devices, keys, got_all):
        msg = decode(raw)
        if not isinstance(msg, IterationReport):
            raise ValueError(f"{k} holds a {type(msg).__name__}, not an iteration report")
        out[d] = msg
    return out


def put_fingerprint(store: KeyValueStore, generation: int, iteration: int, device: int, text: str) -> None:
    """A device's state fingerprint after ``iteration``'s optimizer step (docs/sdc.md)."""
    store.set(_fingerprint(generation, iteration, device), text)


def get_fingerprints(store: KeyValueStore, generation: int, iteration: int,
                     devices: Iterable[int]) -> dict[int, str]:
    """The fingerprints ``devices`` posted for ``iteration`` (absent ones left out).
    Two round trips when all were posted (one check, one multi-get), else one or two
    per device."""
    devices = list(devices)
    keys = [_fingerprint(generation, iteration, d) for d in devices]
    multi_get = getattr(store, "multi_get", None)
    if keys and multi_get is not None and store.check(keys):
        try:
            got_all = multi_get(keys)
        except TypeError:  # a store whose multi_get wants a timeout as well
            got_all = None
        if got_all is not None:
            return {d: g.decode() if isinstance(g, bytes) else str(g) for d, g in zip(devices, got_all)}
    out: dict[int, str] = {}
    for d in devices:
        key = _fingerprint(generation, iteration, d)
        if store.check([key]):
            got = store.get(key)
            out[d] = got.decode() if isinstance(got, bytes) else str(got)
    return out


def put_sdc_finding(store: KeyValueStore, generation: int, iteration: int, text: str) -> None:
    """Why ``iteration`` was aborted for silent data corruption (written before the
    abort verdict, so whoever reads the verdict finds it)."""
    store.set(_sdc(generation, iteration), text)


def get_sdc_finding(store: KeyValueStore, generation: int, iteration: int) -> str | None:
    key = _sdc(generation, iteration)
    if not store.check([key]):
        return None
    got = store.get(key)
    return got.decode() if isinstance(got, bytes) else str(got)


def put_left(store: KeyValueStore, left: WorkerLeft) -> None:
    """Say why a worker left generation ``left.generation``."""
    store.set(_failed(left.generation, left.device), encode(left))


def has_left(store: KeyValueStore, generation: int, device: int) -> bool:
    return bool(store.check([_failed(generation, device)]))


def get_left(store: KeyValueStore, generation: int, device: int) -> WorkerLeft | None:
    """Why ``device`` left ``generation`` (None: it did not). A value that is not a
    :class:`~resihp_core.protocol.WorkerLeft` (plain text) reads as a reason with no
    state-lost signal."""
    key = _failed(generation, device)
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        msg = decode(raw)
    except ProtocolError:
        msg = None
    if isinstance(msg, WorkerLeft):
        return msg
    return WorkerLeft(generation=generation, device=device, reason=bytes(raw).decode(errors="replace"))


def put_ready(store: KeyValueStore, generation: int, device: int, timings: dict[str, float | str]) -> None:
    """This worker finished reconfiguring into ``generation`` (its timings)."""
    store.set(_ready(generation, device), json.dumps(timings))


def get_ready(store: KeyValueStore, generation: int, device: int) -> dict[str, float | str] | None:
    """The timings ``device`` posted on entering ``generation``; None if it has not, or
    if what it posted is not a JSON object (a worker's bytes are not trusted)."""
    key = _ready(generation, device)
    if not store.check([key]):
        return None
    try:
        got = json.loads(store.get(key))
    except ValueError:  # not JSON, or not UTF-8
        return None
    return got if isinstance(got, dict) else None


def put_pid(store: KeyValueStore, device: int, pid: int) -> None:
    """The worker of ``device`` is up (its adapter exists) with process id ``pid``."""
    store.set(_pid(device), str(pid))


def clear_pid(store: KeyValueStore, device: int) -> None:
    try:
        store.delete_key(_pid(device))
    except Exception:  # noqa: BLE001 - absent
        pass


def pids_posted(store: KeyValueStore, devices: list[int]) -> bool:
    return bool(store.check([_pid(d) for d in devices]))


@dataclass(frozen=True)
class StorageFault:
    """A checkpoint write that failed on a worker: reported, never fatal."""

    device: int
    iteration: int
    error: str


def put_storage_fault(store: KeyValueStore, fault: StorageFault) -> None:
    n = store.add(_FAULTS, 1)
    store.set(_fault(n), json.dumps({"device": fault.device, "iteration": fault.iteration, "error": fault.error}))


def storage_faults(store: KeyValueStore, seen: int) -> list[StorageFault]:
    """The storage faults posted after the first ``seen`` (in order; one counted but
    not posted yet ends the list: it comes next time)."""
    n = store.add(_FAULTS, 0)
    out: list[StorageFault] = []
    while seen + len(out) < n:
        key = _fault(seen + len(out) + 1)
        if not store.check([key]):
            break
        st = json.loads(store.get(key))
        out.append(StorageFault(device=int(st["device"]), iteration=int(st["iteration"]), error=str(st["error"])))
    return out


def put_job_end(store: KeyValueStore, error: JobError | ScriptEnded) -> None:
    """Post how the job ends on a worker other than by a device failure: its own error,
    or its script's early end (docs/errors.md), in the next numbered slot."""
    n = store.add(_JOB_ERRORS, 1)
    store.set(f"joberror/{n}", encode(error))


def job_ends(store: KeyValueStore, seen: int) -> tuple[list[JobError | ScriptEnded], int]:
    """The job errors and early ends posted after the first ``seen`` and the new count seen (a slot
    counted but not written yet ends the list: it comes next time). An entry that does
    not decode as a :class:`~resihp_core.protocol.JobError` is skipped (hostile input)."""
    n = store.add(_JOB_ERRORS, 0)
    out: list[JobError | ScriptEnded] = []
    while seen < n:
        key = f"joberror/{seen + 1}"
        if not store.check([key]):
            break
        seen += 1
        try:
            msg = decode(store.get(key))
        except ProtocolError:
            continue
        if isinstance(msg, (JobError, ScriptEnded)):
            out.append(msg)
    return out, seen


def rendezvous_store(store: dist.Store, generation: int) -> dist.PrefixStore:
    """Generation ``generation``'s torch.distributed rendezvous: a ``PrefixStore`` over
    the (fenced) job store, so no key of one generation meets another's."""
    import torch.distributed as dist

    return dist.PrefixStore(_rendezvous(generation), store)


def join_members(rendezvous: dist.Store, rank: int, device: int, world: int, timeout: datetime.timedelta) -> None:
    """Say ``rank`` (device ``device``) joined a generation's ``rendezvous`` (from
    :func:`rendezvous_store`) and wait for all ``world`` ranks, under ``timeout``.
    Survivors arrive late by up to one collective timeout (blocked in the superseded
    generation), so a group waits here under the long join timeout first and its own
    operations keep the short one."""
    rendezvous.set(_joined(rank), str(device))
    rendezvous.wait([_joined(r) for r in range(world)], timeout)


# ------------------------------------------------------------------ the controller's side
Layout = Literal["moved", "kept", "unknown"]


class Observers(Protocol):
    """The observer hooks a session notifies (:class:`~resihp_core.plugins.Plugins`)."""

    def notify_failure(self, report: FailureReport) -> None: ...
    def notify_plan_changed(self, old: ParallelPlan | None, new: ParallelPlan, reason: str) -> None: ...
    def notify_iteration(self, metrics: object) -> None: ...
    def notify_job_started(self, config: object, workdir: str) -> None: ...


class JobSession:
    """The controller's view of one job's shared state, and its only writer.

    It owns the single generation counter (:attr:`generation`: a plan's own number is
    stamped here when it is posted, nowhere else), reads the commit verdicts
    (:meth:`committed_through`) and writes the abort verdicts (:meth:`abort`), reads
    what workers reported, and is the only place observers are notified and events
    logged (:meth:`publish`, :meth:`failure`, :meth:`plan_changed`, :meth:`iteration`).

    :param store: the job store as the controller sees it (every key writable).
    :param observers: the plugin facade (None: no observers).
    :param on_event: called with each event after it is kept and logged.
    :param clock: the time source events are stamped with (seconds, monotonic).
    """

    def __init__(self, store: KeyValueStore, *, observers: Observers | None = None,
                 on_event: Callable[[JobEvent], None] = lambda ev: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.observers = observers
        self.on_event = on_event
        self.clock = clock
        self._t0 = clock()
        self.generation = -1
        self.plan: ParallelPlan | None = None
        self.message: PlanUpdate | None = None
        self.plans: dict[int, ParallelPlan] = {}
        self.committed = 0  # iterations known committed
        self.committed_in: dict[int, int] = {}  # iteration -> generation that committed it
        self.events: list[JobEvent] = []
        self._faults_seen = 0
        self._job_errors_seen = 0

    # ------------------------------------------------------------ generations
    def post(self, plan: ParallelPlan, *, devices: tuple[int, ...], iterations: int, resume: int | None = None,
             restore: int | None = None, fresh: bool = False,
             memory_holders: dict[str, list[int]] | None = None) -> int:
        """Post the next generation: ``plan`` for the live workers ``devices``
        (``memory_holders``: ``restore`` reads peers' memory copies, not a checkpoint)."""
        g = self.generation + 1
        plan = plan.with_(generation=g) if plan.generation != g else plan
        msg = PlanUpdate.of(plan, devices=devices, resume=self.committed if resume is None else resume,
                            iterations=iterations, restore=restore, fresh=fresh, memory_holders=memory_holders)
        post_plan(self.store, msg)
        self.generation, self.plan, self.message = g, plan, msg
        self.plans[g] = plan
        return g

    def stop(self) -> None:
        """Post the job's end: every worker finishes and exits."""
        g = self.generation + 1
        post_plan(self.store, PlanUpdate(generation=g, stop=True))
        self.generation = g

    def latest(self) -> PlanUpdate | None:
        """The newest generation posted in the store (a restarted controller reads it)."""
        g = latest_generation(self.store)
        return None if g < 0 else read_plan(self.store, g)

    def adopt(self, msg: PlanUpdate) -> None:
        """Take over generation ``msg`` its workers are in (no post)."""
        plan = msg.parsed_plan()
        self.generation, self.plan, self.message = msg.generation, plan, msg
        self.plans[msg.generation] = plan
        self.committed = msg.resume
        self.committed_through()

    def abort(self) -> int:
        """Abort the current generation; returns the iteration to resume from."""
        first = self.committed
        self.committed = abort_generation(self.store, self.generation, first)
        for i in range(first, self.committed):  # committed before the abort, not yet seen
            self.committed_in[i] = self.generation
        return self.committed

    def committed_through(self) -> int:
        """Advance :attr:`committed` over iterations whose verdict is ``commit``."""
        g = self.generation
        while verdict(self.store, g, self.committed) == CommitResult.COMMITTED:
            self.committed_in[self.committed] = g
            self.committed += 1
        return self.committed

    # ------------------------------------------------------------ what workers reported
    def _members(self) -> tuple[int, ...]:
        return self.message.devices if self.message else ()

    def ready_info(self, generation: int | None = None) -> dict[int, dict[str, float | str]]:
        """Per-device reconfiguration breakdown of a generation (rebuild, state, bytes)."""
        g = self.generation if generation is None else generation
        out = {}
        for d in self._members():
            info = get_ready(self.store, g, d)
            if info is not None:
                out[d] = info
        return out

    def workers_left(self, generation: int | None = None) -> dict[int, WorkerLeft]:
        """Devices that left ``generation`` (default: current), with their typed reports."""
        g = self.generation if generation is None else generation
        out = {}
        for d in self._members():
            left = get_left(self.store, g, d)
            if left is not None:
                out[d] = left
        return out

    def layout(self, generation: int, devices: list[int]) -> dict[int, Layout]:
        """Where each of ``devices`` stands after entering ``generation``: ``moved`` (it
        finished reconfiguring), ``kept`` (it gave up, its previous layout kept) or
        ``unknown`` (still busy, or stuck)."""
        out: dict[int, Layout] = {}
        for d in devices:
            if self.store.check([_ready(generation, d)]):
                out[d] = "moved"
            elif has_left(self.store, generation, d):
                out[d] = "kept"
            else:
                out[d] = "unknown"
        return out

    def report(self, iteration: int, generation: int | None = None) -> dict[int, IterationReport]:
        """Per-device reports of ``iteration`` in ``generation`` (default: the one that
        committed it)."""
        g = self.committed_in.get(iteration, self.generation) if generation is None else generation
        out = {}
        for d in self.plans[g].devices():
            r = get_report(self.store, g, iteration, d)
            if r is not None:
                out[d] = r
        return out

    def new_job_ends(self) -> list[JobError | ScriptEnded]:
        """Job errors and early ends workers posted since the last call (docs/errors.md)."""
        got, self._job_errors_seen = job_ends(self.store, self._job_errors_seen)
        return got

    def new_storage_faults(self) -> list[StorageFault]:
        """Storage faults posted since the last call."""
        got = storage_faults(self.store, self._faults_seen)
        self._faults_seen += len(got)
        return got

    # ------------------------------------------------------------ workers' processes
    def forget_worker(self, device: int) -> None:
        """A worker is started again: its new process posts its own pid."""
        clear_pid(self.store, device)

    def workers_up(self, devices: list[int]) -> bool:
        return pids_posted(self.store, devices)

    # ------------------------------------------------------------ the controller's presence
    def steer(self) -> None:
        """A controller steers the job: a store hosted in its own process lets the
        workers commit from now on (docs/failover.md)."""
        self.store.set(PRESENT_KEY, "1")

    def end_store_host(self) -> None:
        """Tell a store host (its own process) that the job is over."""
        self.store.set(SHUTDOWN_KEY, "1")

    # ------------------------------------------------------------ observers
    def publish(self, event: JobEvent, *, at: int | None = None) -> JobEvent:
        """Stamp ``event`` with the time, the plan generation and the iteration the job
        was at (``at``; default: the committed count, not the one a restore rewinds
        to), keep it, log it and hand it on."""
        it = self.committed if at is None else at
        ev = msgspec.structs.replace(event, time=self.clock() - self._t0, iteration=it, generation=self.generation)
        self.events.append(ev)
        logger.info("event=%s generation=%d iteration=%d %s", ev.kind, self.generation, it, ev.text)
        self.on_event(ev)
        return ev

    def failure(self, report: FailureReport) -> None:
        """One failure, told to observers once (merged reports of it are one)."""
        if self.observers is not None:
            self.observers.notify_failure(report)

    def plan_changed(self, old: ParallelPlan | None, new: ParallelPlan, reason: str) -> None:
        if self.observers is not None:
            self.observers.notify_plan_changed(old, new, reason)

    def iteration(self, metrics: IterationMetrics) -> None:
        if self.observers is not None:
            self.observers.notify_iteration(metrics)

    def job_started(self, config: object, workdir: str) -> None:
        if self.observers is not None:
            self.observers.notify_job_started(config, workdir)


# ------------------------------------------------------------------ rendezvous fence
_RENDEZVOUS_KEY = re.compile(r"^/*gen(\d+)/")  # what _rendezvous(g) spells


def rendezvous_generation(keys: list[str]) -> int | None:
    """The generation whose rendezvous ``keys`` belong to (``gen<g>/...``, as a
    ``PrefixStore`` writes them), or None for any other key."""
    for k in keys:
        m = _RENDEZVOUS_KEY.match(k)
        if m:
            return int(m.group(1))
    return None


class Superseded(RuntimeError):
    """A wait in generation ``g``'s rendezvous ended because a newer one was posted."""


_FENCED_CLASS: type[dist.Store] | None = None


def generation_fenced(store: dist.Store, latest: Callable[[], int], *, patience_s: float,
                      poll_s: float = 0.2) -> dist.Store:
    """The worker's job store as its adapter sees it: every operation passes through,
    except that a wait (``wait``, ``get``, ``multi_get``) on keys of generation ``g``'s
    rendezvous (``gen<g>/...``) is cut into ``poll_s`` slices and

    - ends with :class:`Superseded` (a ``DistStoreError``) within ``poll_s`` once
      ``latest()`` exceeds ``g``: a worker still meeting in a superseded generation
      leaves at once for the new one, instead of holding its new peers up for the
      store timeout;
    - otherwise waits ``max(timeout, patience_s)``: while its generation is current a
      slow peer (a loaded host) is worth waiting for; a dead one is reported by the
      Detector and its generation superseded, which ends the wait.

    Without this, peers of one generation can end up in different groups of it: one
    times out in group k (its key stays in the store) while a late peer passes group k
    on that key and waits in group k+1 for a peer that has left (docs/worker-protocol.md).
    """
    global _FENCED_CLASS
    if _FENCED_CLASS is None:
        _FENCED_CLASS = _fenced_class()
    return _FENCED_CLASS(store, latest, patience_s, poll_s)


def _fenced_class() -> type[dist.Store]:
    import torch.distributed as dist

    class SupersededStoreError(Superseded, dist.DistStoreError):
        """Raised through torch.distributed: a store error, and :class:`Superseded`."""

    _superseded, _timeout = SupersededStoreError, dist.DistStoreError

    class GenerationFencedStore(dist.Store):
        def __init__(self, inner: dist.Store, latest: Callable[[], int], patience_s: float, poll_s: float) -> None:
            super().__init__()
            self._inner, self._latest = inner, latest
            self._patience_s, self._poll_s = patience_s, poll_s
            self._timeout_s = _seconds(getattr(inner, "timeout", None), 300.0)

        def _fence(self, keys: list[str], timeout_s: float | None) -> None:
            """Wait for ``keys`` of a rendezvous, leaving when superseded."""
            g = rendezvous_generation(keys)
            if g is None:
                return
            budget = max(self._timeout_s if timeout_s is None else timeout_s, self._patience_s)
            deadline = time.monotonic() + budget
            while True:
                latest = self._latest()
                if latest > g:
                    raise _superseded(f"generation {g} was superseded by generation {latest} while "
                                      f"waiting in its rendezvous for {keys[:2]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _timeout(f"rendezvous of generation {g} timed out after {budget:.0f} s "
                                   f"waiting for keys {keys[:4]}")
                try:
                    self._inner.wait(keys, datetime.timedelta(seconds=min(self._poll_s, left)))
                    return
                except dist.DistStoreError as e:
                    if "timed out" not in str(e) and "timeout" not in str(e):
                        raise  # a lost connection, not a slice that ran out

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self._timeout_s = _seconds(timeout, self._timeout_s)

        @property
        def timeout(self) -> datetime.timedelta:  # type: ignore[override]
            return datetime.timedelta(seconds=self._timeout_s)

        def set(self, key: str, value: str | bytes) -> None:
            self._inner.set(key, value)

        def get(self, key: str) -> bytes:
            self._fence([key], None)
            return self._inner.get(key)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self._fence(list(keys), None)
            return self._inner.multi_get(keys)

        def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
            self._inner.multi_set(keys, values)

        def add(self, key: str, value: int) -> int:
            return self._inner.add(key, value)

        def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
            return self._inner.compare_set(key, expected_value, desired_value)

        def append(self, key: str, value: str | bytes) -> None:
            self._inner.append(key, value)

        def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
            keys = list(keys)
            if rendezvous_generation(keys) is None:
                self._inner.wait(keys, timeout) if timeout is not None else self._inner.wait(keys)
                return
            self._fence(keys, None if timeout is None else _seconds(timeout, self._timeout_s))

        def check(self, keys: list[str]) -> bool:
            return self._inner.check(keys)

        def delete_key(self, key: str) -> bool:
            return self._inner.delete_key(key)

        def num_keys(self) -> int:
            return self._inner.num_keys()

    return GenerationFencedStore


def _seconds(timeout: datetime.timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return default if s <= 0 else s
