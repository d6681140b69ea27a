"""Peer memory copies: each rank's committed state is also held in the host memory of a
rank on another node, so that a restore after a whole stage is lost reads the
survivors' memory instead of a checkpoint on disk (docs/checkpoints.md, "Memory
copies on peers").

Three parts, all here:

- the **holder** of every worker (:class:`PeerCopies`): a small TCP listener of its
  own (a side channel: no process group, so a reconfiguration never waits for it and
  a broken group never breaks it) that keeps, per source rank, the serialized pieces
  of that rank's newest three copies, and says in the job store what it holds
  (``peer/held/<device>``);
- the **sender**: at a due iteration the training thread hands over the pieces of its
  rollback snapshot (references, no copy: the adapter's ``memory_copy``); a background
  thread serializes them into host memory, keeps that as this rank's own copy and
  sends it to the buddy (:func:`buddy_of`); the next due copy waits for it;
- the **controller's rule** (:func:`memory_restore_point`, framework-neutral: json and
  the store only): the newest iteration before the resume point of which every
  component of the model, every part of it, is held by a live worker, in a copy taken
  after the iteration that committed it (a copy of an iteration that a later restore
  trained again is stale).

Store keys (written by workers; the controller only reads them): ``peer/addr/<d>``
(host, port, node, access token), ``peer/model`` (the model's component names),
``peer/held/<d>`` (the pieces ``d`` holds: source, iteration, generation, component,
part, parts). A client proves it read the token from the job store (an HMAC of a
fresh challenge), so only the job's own processes read or write copies.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from resihp_core.protocols.store import KeyValueStore

if TYPE_CHECKING:
    from torch import Tensor

    from resihp_core.plan import ParallelPlan

__all__ = ["MemoryPiece", "MemoryCopy", "PeerCopies", "PeerCopyError", "buddy_of", "memory_restore_point",
           "HELD_KEY", "MODEL_KEY", "ADDR_KEY", "KEEP_PER_SOURCE"]

logger = logging.getLogger("resihp.peercopy")

ADDR_KEY = "peer/addr/{}"
HELD_KEY = "peer/held/{}"
MODEL_KEY = "peer/model"
#: Copies kept per source rank. Every rank hands over each due copy only once its
#: previous one has left, so the ranks' newest held copies are at most two due
#: iterations apart (the commit keeps them in step): three per source always leave an
#: iteration every source has a copy of.
KEEP_PER_SOURCE = 3
_HDR = struct.Struct("!I")
_BODY = struct.Struct("!Q")
_MAX_HEADER = 1 << 20


class PeerCopyError(OSError):
    """A memory copy could not be read (its holder died, the piece is gone): an
    ``OSError``, so the worker reports it like an unreadable checkpoint and the
    supervisor restores again, from disk."""


@dataclass(frozen=True)
class MemoryPiece:
    """One part of one component of the model: the tensors (parameter, then optimizer
    state) of every parameter name in it, part ``part`` of ``parts`` (a TP shard; the
    adapter says how parts join)."""

    component: str
    part: int
    parts: int
    tensors: Mapping[str, tuple[Tensor, ...]]


@dataclass(frozen=True)
class MemoryCopy:
    """What a rank hands over for its peers: its pieces, and the names of every
    component of the model (a complete copy holds every part of each)."""

    pieces: tuple[MemoryPiece, ...]
    components: tuple[str, ...]


# ------------------------------------------------------------------ placement
def buddy_of(device: int, devices: Iterable[int], node_of: Mapping[int, int],
             stage_of: Callable[[int], int | None]) -> int | None:
    """The rank that holds ``device``'s copy: going round the generation's ``devices``
    in id order from ``device``, the first on another node that holds another stage (or
    none: a standby), else the first on another node, else the first other device (a
    one-node job: the copy survives a process but not a node), else None. Every rank
    computes it from the plan and the nodes alone; a new generation re-chooses."""
    ring = sorted(set(devices) | {device})
    k = ring.index(device)
    others = ring[k + 1:] + ring[:k]
    mine, node = stage_of(device), node_of.get(device, -1 - device)
    far = [d for d in others if node_of.get(d, -1 - d) != node]
    for d in far:
        s = stage_of(d)
        if s is None or s != mine:
            return d
    if far:
        return far[0]
    return others[0] if others else None


# ------------------------------------------------------------------ the controller's rule
def _read_json(store: KeyValueStore, key: str) -> object | None:
    try:
        if not store.check([key]):
            return None
        return json.loads(store.get(key))
    except (ValueError, RuntimeError, OSError):
        return None


def memory_restore_point(store: KeyValueStore, live: Iterable[int], resume: int,
                         committed_in: Mapping[int, int], why: list[str] | None = None,
                         ) -> tuple[int, dict[str, list[int]]] | None:
    """The newest iteration ``< resume`` whose complete state live workers hold in
    memory, and for each component the holder of each of its parts; None if there is
    none (then ``why``, if given, gets a sentence saying what is missing). A copy counts
    only if taken in a generation at or after the one that committed its iteration
    (``committed_in``): an older one belongs to a history a restore has since trained
    again."""
    why = [] if why is None else why
    model = _read_json(store, MODEL_KEY)
    if not isinstance(model, list) or not model or resume <= 0:
        why.append("no rank has handed over a memory copy yet")
        return None
    # iteration -> (component, parts) -> part -> holders
    held: dict[int, dict[tuple[str, int], dict[int, set[int]]]] = {}
    for d in sorted(set(live)):
        entries = _read_json(store, HELD_KEY.format(d))
        if not isinstance(entries, list):
            continue
        for e in entries:
            try:
                _src, it, gen, comp, part, parts = e
                it, gen, part, parts = int(it), int(gen), int(part), int(parts)
            except (TypeError, ValueError):
                continue
            if it >= resume or gen < committed_in.get(it, 0):
                continue
            held.setdefault(it, {}).setdefault((str(comp), parts), {}).setdefault(part, set()).add(d)
    for it in sorted(held, reverse=True):
        got: dict[str, list[int]] = {}
        for comp in model:
            for (c, parts), by_part in sorted(held[it].items()):
                if c == comp and all(t in by_part for t in range(parts)):
                    got[comp] = [min(by_part[t]) for t in range(parts)]
                    break
            else:
                break
        if len(got) == len(model):
            return it, got
    if not held:
        why.append(f"live devices {sorted(set(live))} hold no memory copy of an iteration before {resume}")
    else:
        it = max(held)
        have = {c for (c, parts), by_part in held[it].items() if all(t in by_part for t in range(parts))}
        why.append(f"live devices {sorted(set(live))} hold no complete memory copy: the newest, of iteration {it}, "
                   f"lacks {', '.join(c for c in model if c not in have)}")
    return None


# ------------------------------------------------------------------ wire format
def _send_frame(sock: socket.socket, header: dict, body: bytes = b"") -> None:
    h = json.dumps(header).encode()
    sock.sendall(_HDR.pack(len(h)) + h + _BODY.pack(len(body)))
    if body:
        sock.sendall(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise PeerCopyError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> tuple[dict, bytes]:
    (n,) = _HDR.unpack(_recv_exact(sock, _HDR.size))
    if n > _MAX_HEADER:
        raise PeerCopyError(f"header of {n} bytes refused")
    header = json.loads(_recv_exact(sock, n))
    (m,) = _BODY.unpack(_recv_exact(sock, _BODY.size))
    return header, _recv_exact(sock, m) if m else b""


def _encode(tensors: Mapping[str, tuple[Tensor, ...]]) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({k: [t.detach().cpu() for t in v] for k, v in tensors.items()}, buf)
    return buf.getvalue()


def _decode(piece: tuple[str, int, int], data: bytes) -> MemoryPiece:
    import torch

    got = torch.load(io.BytesIO(data), weights_only=True)
    return MemoryPiece(piece[0], piece[1], piece[2], {k: tuple(v) for k, v in got.items()})


#: (component, part, parts) -> (generation the copy was taken in, serialized tensors)
_Pieces = dict[tuple[str, int, int], tuple[int, bytes]]


# ------------------------------------------------------------------ a worker's holder and sender
class PeerCopies:
    """One worker's holder (listener) and sender; see the module docstring.

    :param store: a job-store connection of its own (the background threads write the
        holder's index through it while the training thread waits in the store).
    :param node: this worker's node (``RESIHP_NODE``); ``host`` the address peers
        reach it at (``RESIHP_HOST_ADDR``).
    """

    def __init__(self, device: int, store: KeyValueStore, *, node: int, host: str = "127.0.0.1",
                 timeout_s: float = 30.0) -> None:
        self.device, self.store, self.node, self.timeout_s = device, store, node, timeout_s
        self._token = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._held: dict[tuple[int, int], _Pieces] = {}  # (source, iteration) ->
        self._slot: tuple[int, int, MemoryCopy, int | None] | None = None
        self._wake = threading.Condition(self._lock)
        self._busy = False
        self.sent = 0  # copies delivered to a buddy (for the worker's log)
        host = "127.0.0.1" if host == "localhost" else host
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        port = self._listener.getsockname()[1]
        # A relaunched worker holds nothing yet: its previous life's index goes first.
        store.set(HELD_KEY.format(device), "[]")
        store.set(ADDR_KEY.format(device), json.dumps({"host": host, "port": port, "node": node,
                                                       "token": self._token}))
        self._addr_cache: dict[int, dict] = {}
        threading.Thread(target=self._serve, daemon=True, name="resihp-peercopy-listen").start()
        threading.Thread(target=self._send_loop, daemon=True, name="resihp-peercopy-send").start()

    @classmethod
    def from_env(cls, device: int, store: KeyValueStore, env: Mapping[str, str] = os.environ,
                 timeout_s: float = 30.0) -> PeerCopies:
        node = int(env.get("RESIHP_NODE", "") or -1 - device)
        return cls(device, store, node=node, host=env.get("RESIHP_HOST_ADDR", "") or "127.0.0.1",
                   timeout_s=timeout_s)

    # ------------------------------------------------------------ placement
    def node_of(self, devices: Iterable[int]) -> dict[int, int]:
        """Each device's node, as its holder published it (unknown: its own node)."""
        return {d: int(a["node"]) for d in devices if (a := self._addr(d, cached=True)) is not None}

    def _addr(self, device: int, *, cached: bool = False) -> dict | None:
        if cached and device in self._addr_cache:
            return self._addr_cache[device]
        got = _read_json(self.store, ADDR_KEY.format(device))
        if isinstance(got, dict):
            self._addr_cache[device] = got
            return got
        return None

    # ------------------------------------------------------------ the training thread's side
    def offer(self, iteration: int, generation: int, copy: MemoryCopy, devices: Iterable[int],
              plan: ParallelPlan, *, wait_s: float = 60.0, stop: Callable[[], bool] = lambda: False) -> bool:
        """Queue this rank's copy of (committed) ``iteration`` for its own holder and its
        buddy; the background thread does the rest. If the previous copy has not left
        yet, wait for it first (up to ``wait_s``, or until ``stop()``: a superseded
        generation): no due copy is skipped, so every rank's copies stay in step. Past
        that the previous one is still sent and this one waits in its place (False)."""
        devices = list(devices)

        def stage_of(d: int) -> int | None:
            loc = plan.location(d)
            return None if loc is None else loc[1]

        buddy = buddy_of(self.device, devices, self.node_of(devices), stage_of)
        deadline = time.monotonic() + wait_s
        with self._lock:
            while (self._slot is not None or self._busy) and time.monotonic() < deadline and not stop():
                self._wake.wait(0.05)
            in_step = self._slot is None and not self._busy
            if not in_step:
                logger.warning("event=peercopy_behind device=%d iteration=%d: the previous copy has not left",
                               self.device, iteration)
            self._slot = (iteration, generation, copy, buddy)
            self._wake.notify_all()
        return in_step

    def idle(self, timeout: float) -> bool:
        """Wait until no copy is queued or being sent (tests, the job's end)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._slot is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """The job's end: let a copy on the wire finish (briefly), stop listening."""
        self.idle(timeout)
        try:
            self._listener.close()
        except OSError:
            pass

    def reader(self, iteration: int, holders: Mapping[str, list[int]]) -> Callable[[str], list[MemoryPiece]]:
        """At a restore from memory: ``read(component)`` gives every part of the
        component's copy of ``iteration`` (from this holder or a peer's); raises
        :class:`PeerCopyError` if a holder cannot give it."""

        def read(component: str) -> list[MemoryPiece]:
            if component not in holders:
                raise PeerCopyError(f"the restore names no holder of component {component!r}")
            parts = holders[component]
            out = []
            for t, h in enumerate(parts):
                key = (component, t, len(parts))
                data = self._local(iteration, key) if h == self.device else self._fetch(h, iteration, key)
                if data is None:
                    raise PeerCopyError(f"device {h} holds no memory copy of iteration {iteration}, "
                                        f"component {component!r} part {t} of {len(parts)}")
                out.append(_decode(key, data))
            return out

        return read

    # ------------------------------------------------------------ holding
    def _local(self, iteration: int, key: tuple[str, int, int]) -> bytes | None:
        """The newest-generation copy of one piece of ``iteration`` held here."""
        with self._lock:
            got = [pieces[key] for (_src, it), pieces in self._held.items() if it == iteration and key in pieces]
            return max(got, key=lambda g: g[0])[1] if got else None

    def _keep(self, source: int, iteration: int, generation: int, pieces: dict[tuple[str, int, int], bytes]) -> None:
        """Hold a copy. Pieces of the same source and iteration are merged, not replaced:
        after a re-layout the source may hand over other components of the same state
        while a peer still reads the ones it held before. Drop the source's pieces of a
        history this copy replaces (newer iterations, older generations) and all but its
        newest ``KEEP_PER_SOURCE`` iterations."""
        with self._lock:
            for key in [k for k in self._held if k[0] == source and k[1] > iteration]:
                kept = {p: v for p, v in self._held[key].items() if v[0] >= generation}
                if kept:
                    self._held[key] = kept
                else:
                    del self._held[key]
            have = self._held.setdefault((source, iteration), {})
            for p, data in pieces.items():
                if p not in have or have[p][0] <= generation:
                    have[p] = (generation, data)
            mine = sorted((k for k in self._held if k[0] == source), key=lambda k: k[1], reverse=True)
            for key in mine[KEEP_PER_SOURCE:]:
                del self._held[key]
        self._publish()

    def _publish(self) -> None:
        """Say in the job store what this holder has now. Serialized, so the index the
        store ends up with is the newest one (two peers' copies may land at once)."""
        with self._publish_lock:
            with self._lock:
                index = [[src, it, pieces[(c, t, k)][0], c, t, k] for (src, it), pieces in sorted(self._held.items())
                         for (c, t, k) in sorted(pieces)]
            self.store.set(HELD_KEY.format(self.device), json.dumps(index))

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True,
                             name="resihp-peercopy-conn").start()

    def _connection(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.timeout_s)
            nonce = secrets.token_bytes(16)
            conn.sendall(nonce)
            proof = _recv_exact(conn, 32)
            if not hmac.compare_digest(proof, hmac.new(self._token.encode(), nonce, hashlib.sha256).digest()):
                logger.warning("event=peercopy_refused device=%d reason='bad token'", self.device)
                return
            header, body = _recv_frame(conn)
            if header.get("op") == "put":
                pieces, at = {}, 0
                for c, t, k, n in header["pieces"]:
                    pieces[(str(c), int(t), int(k))] = body[at:at + int(n)]
                    at += int(n)
                if at != len(body):
                    raise PeerCopyError("piece sizes do not add up to the body")
                self._keep(int(header["source"]), int(header["iteration"]), int(header["generation"]), pieces)
                _send_frame(conn, {"ok": True})
            elif header.get("op") == "get":
                key = (str(header["component"]), int(header["part"]), int(header["parts"]))
                data = self._local(int(header["iteration"]), key)
                _send_frame(conn, {"ok": data is not None}, data or b"")
            else:
                _send_frame(conn, {"ok": False, "error": f"unknown op {header.get('op')!r}"})
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("event=peercopy_connection_failed device=%d reason=%r", self.device, str(e)[:200])
        finally:
            conn.close()

    # ------------------------------------------------------------ talking to a peer
    def _connect(self, device: int) -> socket.socket:
        addr = self._addr(device)
        if addr is None:
            raise PeerCopyError(f"device {device} has no peer-copy listener")
        sock = socket.create_connection((addr["host"], int(addr["port"])), timeout=min(5.0, self.timeout_s))
        sock.settimeout(self.timeout_s)
        try:
            nonce = _recv_exact(sock, 16)
            sock.sendall(hmac.new(str(addr["token"]).encode(), nonce, hashlib.sha256).digest())
        except BaseException:
            sock.close()
            raise
        return sock

    def _fetch(self, device: int, iteration: int, key: tuple[str, int, int]) -> bytes | None:
        try:
            with self._connect(device) as sock:
                _send_frame(sock, {"op": "get", "iteration": iteration, "component": key[0], "part": key[1],
                                   "parts": key[2]})
                header, body = _recv_frame(sock)
        except (OSError, ValueError) as e:
            raise PeerCopyError(f"cannot read the memory copy held by device {device}: {e}") from None
        return body if header.get("ok") else None

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while self._slot is None:
                    self._wake.wait()
                job, self._slot = self._slot, None
                self._busy = True
            try:
                self._send(*job)
            except Exception as e:  # noqa: BLE001 - a copy that cannot be kept or sent is skipped, never fatal
                logger.warning("event=peercopy_send_failed device=%d iteration=%d reason=%r", self.device, job[0],
                               f"{type(e).__name__}: {e}"[:200])
            finally:
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()

    def _send(self, iteration: int, generation: int, copy: MemoryCopy, buddy: int | None) -> None:
        pieces = {(p.component, p.part, p.parts): _encode(p.tensors) for p in copy.pieces}
        if not self.store.check([MODEL_KEY]):
            self.store.set(MODEL_KEY, json.dumps(list(copy.components)))
        self._keep(self.device, iteration, generation, pieces)
        if buddy is None or buddy == self.device:
            return
        order = sorted(pieces)
        with self._connect(buddy) as sock:
            _send_frame(sock, {"op": "put", "source": self.device, "iteration": iteration, "generation": generation,
                               "pieces": [[c, t, k, len(pieces[(c, t, k)])] for c, t, k in order]},
                        b"".join(pieces[k] for k in order))
            header, _ = _recv_frame(sock)
        if not header.get("ok"):
            raise PeerCopyError(f"device {buddy} refused the copy of iteration {iteration}")
        self.sent += 1
