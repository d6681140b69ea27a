"""What a restarted controller needs to re-attach to a job that trained on without it
(docs/failover.md): the job's durable state in its work folder, authenticated; the
lock that keeps a second controller off a job; and the grace timer agents and the
store host count a lost controller's absence with.

Everything here is pure or touches only the work folder, so unit tests drive it
without processes.

* :class:`JobState` (``<workdir>/controller-state.json``): where the job store and the
  controller listen, the plan generation, its plan and membership, the devices whose
  failure was handled, the committed iteration. Written at every plan change by the
  running controller, read by ``resihp run --resume``. The file carries an
  HMAC-SHA256 over its body keyed by the job secret; a file whose MAC does not verify,
  or any field out of its bounds, is refused (:class:`StateError`), never half-used.
* The job secret of a job whose secret ``resihp run`` made up (local agents) lives in
  ``<workdir>/job.secret``, mode 0600, owned by the user; a file others may read or
  write, or a link, is refused (:func:`job_secret`).
* :class:`ControllerLock` (``<workdir>/controller.lock``): an ``flock`` held for the
  controller process's life (the kernel drops it when the process dies, however it
  dies), with the holder's pid inside for the refusal message.
* :class:`GraceTimer`: how long a lost controller may stay away.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import os
import secrets as _secrets
import stat
from pathlib import Path
from typing import Annotated, Callable

import msgspec

__all__ = ["ControllerLock", "ControllerRunning", "GraceTimer", "JobState", "StateError",
           "STATE_FILE", "LOCK_FILE", "SECRET_FILE", "job_secret", "read_state", "write_state",
           "remove_state"]

STATE_FILE = "controller-state.json"
LOCK_FILE = "controller.lock"
SECRET_FILE = "job.secret"
MAX_STATE_BYTES = 1 << 20
_MAC_DOMAIN = b"resihp controller state v1\n"

_Dev = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
_Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9.:\[\]_-]+$")]


class StateError(RuntimeError):
    """The job's durable state is missing, unreadable, forged or out of bounds."""


class JobState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A job's state as its controller last wrote it (see the module docstring)."""

    version: Annotated[int, msgspec.Meta(ge=1, le=1)]
    controller_host: _Host
    controller_port: _Port
    store_address: Annotated[str, msgspec.Meta(min_length=3, max_length=300, pattern=r"^[A-Za-z0-9.:\[\]_-]+:\d{1,5}$")]
    store_pid: Annotated[int, msgspec.Meta(ge=1, le=1 << 22)]
    generation: _Count
    committed: _Count
    iterations: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
    plan: Annotated[str, msgspec.Meta(min_length=1, max_length=1 << 19)]
    devices: Annotated[tuple[_Dev, ...], msgspec.Meta(min_length=1, max_length=1 << 16)]
    handled: Annotated[tuple[_Dev, ...], msgspec.Meta(max_length=1 << 16)] = ()
    nodes: Annotated[tuple[_Dev, ...], msgspec.Meta(max_length=1 << 16)] = ()

    def __post_init__(self) -> None:
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("devices repeat")
        if set(self.devices) & set(self.handled):
            raise ValueError("a device is both in the membership and handled as failed")
        if self.committed > self.iterations:
            raise ValueError("committed exceeds iterations")


def _key(secret: str | bytes) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise StateError("the job secret is empty")
    return hashlib.sha256(b"resihp controller state key\n" + raw).digest()


def _mac(secret: str | bytes, body: bytes) -> str:
    return hmac.new(_key(secret), _MAC_DOMAIN + body, hashlib.sha256).hexdigest()


def write_state(workdir: str | os.PathLike, state: JobState, secret: str | bytes) -> Path:
    """Write ``state`` atomically (temporary file, fsync, rename), mode 0600."""
    body = msgspec.json.encode(state)
    blob = msgspec.json.encode({"mac": _mac(secret, body), "state": msgspec.Raw(body)})
    path = Path(workdir) / STATE_FILE
    tmp = path.with_name(f"{STATE_FILE}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, blob)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    mac: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    state: msgspec.Raw


def read_state(workdir: str | os.PathLike, secret: str | bytes) -> JobState:
    """The job's state, after its MAC verifies with ``secret``; :class:`StateError`
    otherwise (missing, too large, forged, malformed, out of bounds)."""
    path = Path(workdir) / STATE_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise StateError(f"no controller state in {workdir}") from None
    except OSError as e:
        raise StateError(f"cannot read {path}: {e}") from None
    try:
        data = os.read(fd, MAX_STATE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_STATE_BYTES:
        raise StateError(f"{path} is larger than {MAX_STATE_BYTES} bytes: refused")
    try:
        env = msgspec.json.decode(data, type=_Envelope)
    except msgspec.MsgspecError as e:
        raise StateError(f"{path} is not a controller state file: {e}") from None
    body = bytes(env.state)
    if not hmac.compare_digest(_mac(secret, body), env.mac):
        raise StateError(f"{path} does not verify with the job secret (altered, or another job's): refused")
    try:
        return msgspec.json.decode(body, type=JobState)
    except (msgspec.MsgspecError, ValueError) as e:
        raise StateError(f"{path}: a field is out of bounds: {e}") from None


def remove_state(workdir: str | os.PathLike) -> None:
    """The job is over: nothing is left to re-attach to."""
    try:
        os.unlink(Path(workdir) / STATE_FILE)
    except FileNotFoundError:
        pass


def job_secret(workdir: str | os.PathLike, *, create: bool) -> str:
    """The job secret kept in ``<workdir>/job.secret`` (made, 32 random bytes in hex,
    if ``create`` and absent). Refused if the file is a link, not a regular file, not
    the user's, or open to group or others."""
    path = Path(workdir) / SECRET_FILE
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            try:
                os.write(fd, _secrets.token_hex(32).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        why = "it is a link" if e.errno == errno.ELOOP else str(e)
        raise StateError(f"cannot use the job secret file {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"{path} is not a regular file: refused")
        if st.st_uid != os.geteuid():
            raise StateError(f"{path} belongs to uid {st.st_uid}, not to this user: refused")
        if st.st_mode & 0o077:
            raise StateError(f"{path} is open to group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                             "refused; it must be 0600")
        raw = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if len(raw) < 32 or not raw.isalnum():
        raise StateError(f"{path} does not hold a job secret")
    return raw


class ControllerRunning(RuntimeError):
    """Another controller holds the job's lock."""

    def __init__(self, workdir: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid else "another process"
        super().__init__(f"a controller ({who}) is already running the job in {workdir}; a second one would "
                         f"fight it for the job's workers: stop that one first (it holds {workdir / LOCK_FILE})")
        self.pid = pid


class ControllerLock:
    """The one-controller-per-job lock (``flock`` on ``<workdir>/controller.lock``)."""

    def __init__(self, workdir: str | os.PathLike) -> None:
        self.workdir = Path(workdir)
        self._fd: int | None = None

    def acquire(self) -> ControllerLock:
        """Take the lock or raise :class:`ControllerRunning` naming the holder."""
        path = self.workdir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise ControllerRunning(self.workdir, int(text) if text.isdigit() else None) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> ControllerLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class GraceTimer:
    """How long a lost controller has been away, against the grace period.

    :param grace_s: the grace period (``runtime.controller_grace_s``); 0: none, a lost
        controller is given up at once.
    :param clock: monotonic seconds (injected for tests).
    """

    def __init__(self, grace_s: float, clock: Callable[[], float]) -> None:
        if grace_s < 0:
            raise ValueError(f"the grace period must be >= 0 s, got {grace_s}")
        self.grace_s = grace_s
        self._clock = clock
        self._since: float | None = None

    def lost(self) -> None:
        """The controller went away (only the first call of an absence counts)."""
        if self._since is None:
            self._since = self._clock()

    def regained(self) -> None:
        self._since = None

    @property
    def absent(self) -> bool:
        return self._since is not None

    def left(self) -> float:
        """Seconds of grace left (the full period while the controller is present)."""
        if self._since is None:
            return self.grace_s
        return max(0.0, self.grace_s - (self._clock() - self._since))

    def expired(self) -> bool:
        return self._since is not None and self.left() <= 0.0
