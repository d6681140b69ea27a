"""The job store in a process of its own, so that it outlives its controller
(docs/failover.md).

``resihp run`` with ``runtime.controller_grace_s > 0`` starts it once per job; the
controller connects to it as ``controller`` (with the job secret), the workers as
before. It keeps ``controller/present`` while a controller is connected: workers hold
their commits while it is absent. It ends when

* the controller sets ``controller/shutdown`` (the job is over), or
* no controller has been connected for the grace period (the controller died and none
  came back: no orphan outlives the job).

Run it (the secret in the environment, never on a command line)::

    RESIHP_SECRET=... python -m resihp_core.runtime.controller.storehost --host H [--port P] \\
        --grace S --address-file F
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

__all__ = ["main", "serve"]

logger = logging.getLogger("resihp.storehost")


def serve(host: str, port: int, secret: str, grace_s: float, address_file: str | None,
          stop: threading.Event, *, poll_s: float = 0.1, first_contact_s: float = 60.0) -> str:
    """Serve the store until shut down or left without a controller for ``grace_s``;
    returns why it ended."""
    from resihp_core.runtime.session import SHUTDOWN_KEY
    from resihp_core.runtime.store import StoreServer

    server = StoreServer(host, secret, port, presence=True)
    if address_file:
        tmp = f"{address_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(server.address + "\n")
        os.replace(tmp, address_file)
    print(server.address, flush=True)
    started = time.monotonic()
    seen = False
    why = "stopped"
    try:
        while not stop.is_set():
            if server.table.check([SHUTDOWN_KEY]):
                why = "the controller ended the job"
                break
            now = time.monotonic()
            if server.controllers > 0:
                seen = True
            elif seen and now - server.controller_left > grace_s:
                why = f"no controller for {grace_s:.0f} s"
                break
            elif not seen and now - started > max(grace_s, first_contact_s):
                why = "no controller ever connected"
                break
            stop.wait(poll_s)
    finally:
        server.close()
    logger.warning("event=store_host_ended reason=%r", why)
    return why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resihp_core.runtime.controller.storehost",
                                 description="ResiHP job store outliving its controller")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--grace", type=float, required=True, help="end after this many seconds without a controller")
    ap.add_argument("--address-file", help="write host:port here once listening")
    ap.add_argument("--secret-env", default="RESIHP_SECRET")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    secret = os.environ.pop(args.secret_env, "")
    if not secret:
        print(f"storehost: the job secret is missing (set {args.secret_env})", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        print(f"storehost: {serve(args.host, args.port, secret, args.grace, args.address_file, stop)}",
              file=sys.stderr, flush=True)
    except OSError as e:
        print(f"storehost: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
