"""Which exceptions are a device's failure and which are the job's own error: the one table.

ResiHP survives devices and links that fail; it does not survive the job's own bugs,
and must not take them for hardware. Every exception a worker sees is classified here,
once, by :func:`classify`:

- **device**: the device or the communication layer failed. A process that dies by a
  signal (SIGKILL, the OOM killer, a segfault) never raises anything and is always a
  device failure; among exceptions, the device kind is:

  * torch.distributed's ``DistError`` family (``DistBackendError``,
    ``DistNetworkError``, ``DistStoreError``): gloo and NCCL errors, a peer's closed
    connection, a collective's timeout;
  * ``ConnectionError`` (reset, refused, aborted, broken pipe) and ``TimeoutError``;
  * ResiHP's own signals that a peer is gone (:class:`~resihp_core.adapter.StateLost`,
    a superseded generation, a broken protocol stream);
  * an exception whose message names a device or transport fault: CUDA errors other
    than a device-side assert (an illegal memory access, an uncorrectable ECC error, a
    launch failure), NCCL errors, gloo's transport errors ("Connection closed by peer",
    "Connection reset by peer", "Timed out waiting ...").

- **job**: anything else raised by the user's script or an adapter's refusal of it:
  ``TypeError``, ``ValueError``, ``KeyError``, a device-side assert (an index out of
  range in the user's model), ``torch.OutOfMemoryError`` (a batch too large for the
  device: the same on every device, not a fault of one), an assertion in user code.
  User code is deterministic: a job error on one rank alone is still the job's.

A job error ends the job at once (``docs/errors.md``): the console names the exception
and the user's ``file:line``; nothing is planned and no fail-stop is reported.

Extend the table from the training script (it runs in the worker, where exceptions are
classified) with :func:`register_device_error`: an exception class, or a regular
expression matched against ``"ClassName: message"``. This module never imports torch.
"""

from __future__ import annotations

import re
import sys
import traceback
from typing import Literal

__all__ = ["ErrorKind", "classify", "register_device_error", "user_frame", "traceback_tail",
           "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_JOB_ERROR", "WORKER_EXIT_JOB_ERROR"]

ErrorKind = Literal["device", "job"]

#: Exit codes of ``resihp run`` / ``resihp launch`` (docs/errors.md).
EXIT_OK = 0  # every configured iteration committed, or the user's loop ended by itself
EXIT_FAILED = 1  # the job could not go on (no plan for the survivors, a timeout)
EXIT_USAGE = 2  # bad usage or configuration, found before training
EXIT_JOB_ERROR = 3  # the job's own code raised (the user's script, or an adapter refused it)

#: A worker process that ends because of a job error exits with this code after
#: posting the error: its exit is expected, not a device's failure.
WORKER_EXIT_JOB_ERROR = 70  # EX_SOFTWARE

# Names, not classes: this module is imported where torch is not.
_DEVICE_CLASS_NAMES = {
    "DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "DistQueueEmptyError",
    "StateLost", "Superseded", "GenerationAborted", "IterationAborted", "ShardsMissing",
    "ProtocolError", "AuthError", "StoreError",
    "AcceleratorError",  # torch >= 2.8 raises CUDA's sticky errors as this class
}
_DEVICE_TYPES: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)

_DEVICE_TEXT = [
    re.compile(r"CUDA error(?!.*device-side assert)", re.IGNORECASE),
    re.compile(r"uncorrectable ECC", re.IGNORECASE),
    re.compile(r"illegal memory access|unspecified launch failure|CUDA driver", re.IGNORECASE),
    re.compile(r"\bNCCL\b|nccl[A-Z]\w*Error|ncclSystemError|ncclRemoteError"),
    re.compile(r"gloo", re.IGNORECASE),
    re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection refused", re.IGNORECASE),
    re.compile(r"Timed out (waiting|after)|operation timed out|Socket Timeout", re.IGNORECASE),
    re.compile(r"ProcessGroup\w* (is )?abort|aborted by|communicator (was )?abort", re.IGNORECASE),
]
_JOB_TEXT = [re.compile(r"device-side assert", re.IGNORECASE)]

_user_types: list[type[BaseException]] = []
_user_text: list[re.Pattern[str]] = []


def register_device_error(match: type[BaseException] | str) -> None:
    """Count exceptions of class ``match`` (or whose ``"ClassName: message"`` matches the
    regular expression ``match``) as device failures. Call it from the training script,
    before training starts."""
    if isinstance(match, str):
        _user_text.append(re.compile(match))
    elif isinstance(match, type) and issubclass(match, BaseException):
        _user_types.append(match)
    else:
        raise TypeError(f"register_device_error takes an exception class or a regular expression, not {match!r}")


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def _one(exc: BaseException) -> ErrorKind | None:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, tuple(_user_types)) or any(p.search(text) for p in _user_text):
        return "device"
    if any(p.search(text) for p in _JOB_TEXT):
        return "job"
    names = {c.__name__ for c in type(exc).__mro__}
    if names & _DEVICE_CLASS_NAMES or isinstance(exc, _DEVICE_TYPES):
        return "device"
    if any(p.search(text) for p in _DEVICE_TEXT):
        return "device"
    return None


def classify(exc: BaseException) -> ErrorKind:
    """``"device"`` if ``exc`` (or an exception it was raised from or while handling)
    is of the device kind (see the module docstring), else ``"job"``."""
    for e in _chain(exc):
        kind = _one(e)
        if kind is not None:
            return kind
    return "job"


_OWN_PACKAGES = ("resihp_core", "resihp_adapters", "resihp_plugins", "torch", "deepspeed", "accelerate",
                 "transformers", "megatron", "runpy", "importlib", "pluggy", "threading", "concurrent")


def user_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback in the user's own code
    (not ResiHP, not a framework, not the standard library); else the innermost frame."""
    where = getattr(exc, "where", None)  # an error about the script as a whole names it
    if isinstance(where, str) and where:
        return where
    if isinstance(exc, SyntaxError) and exc.filename:  # the script itself does not parse
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    stdlib = sys.prefix if sys.prefix == sys.base_prefix else sys.base_prefix

    def own(filename: str) -> bool:
        parts = re.split(r"[\\/]", filename)
        return (any(p in _OWN_PACKAGES for p in parts) or "site-packages" in parts
                or filename.startswith(stdlib) or filename.startswith("<"))

    for f in reversed(frames):
        if not own(f.filename):
            return f"{f.filename}:{f.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def traceback_tail(exc: BaseException, limit: int = 4000) -> str:
    """The formatted traceback of ``exc``, cut from the front to ``limit`` characters."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= limit else "..." + text[-limit:]
