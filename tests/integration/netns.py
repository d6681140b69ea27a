"""Several "hosts" on one machine: Linux network namespaces on a bridge (tests only).

:class:`Hosts` creates a bridge with an address in the root namespace (the
controller's host) and ``n`` namespaces, each with its own ``eth0`` (a veth pair whose
other end is on the bridge) and address in a private /24 picked at random and checked
unused. Names carry a random id, so parallel runs never collide; :meth:`Hosts.close`
kills (by pid) whatever still runs inside the namespaces and deletes every namespace,
veth and the bridge, also when the test failed. Needs root and iproute2.

Processes run in a host through :meth:`Hosts.popen`, in a new UTS namespace whose host
name is ``localhost``: the name resolves to 127.0.0.1, as on many images and
containers, which is what made gloo advertise loopback to remote peers.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

__all__ = ["Hosts", "Host", "unavailable", "tc_unavailable"]

# Exec ``argv`` with the host name set to "localhost" (resolves to 127.0.0.1).
_AS_LOCALHOST = "import os, socket, sys; socket.sethostname('localhost'); os.execvp(sys.argv[1], sys.argv[1:])"


def unavailable() -> str:
    """Why namespaces cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2 / util-linux) is missing"
    return ""


def tc_unavailable() -> str:
    """Why a host's link cannot be rate-limited here ('' when it can): needs the ``tc``
    command and the ``tbf`` queueing discipline (docs: /work/shared/ENVIRONMENT.md)."""
    why = unavailable()
    if why:
        return why
    if shutil.which("tc") is None:
        return "the 'tc' command (iproute2) is missing"
    with Hosts(1) as hosts:
        try:
            hosts.throttle(0, "10mbit")
        except subprocess.CalledProcessError as e:
            return f"tc cannot add a tbf qdisc here: {e.stderr.strip()[:200]}"
    return ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Host:
    index: int
    netns: str
    veth: str  # its link's end on the bridge (root namespace): cut it to partition the host
    address: str


class Hosts:
    """``n`` hosts (network namespaces) on a bridge; the root namespace is the bridge's host."""

    def __init__(self, n: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"rb{tag}"
        used = _ip("-o", "addr").stdout
        for _ in range(50):
            net = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
            if f" {net}." not in used:
                break
        else:
            raise RuntimeError("no free 10.x.y.0/24 for the test network")
        self.net = net
        self.address = f"{net}.1"  # the controller's host on the bridge
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(n):
                h = Host(i, f"rh{tag}{i}", f"rv{tag}{i}", f"{net}.{i + 2}")
                self.hosts.append(h)
                _ip("netns", "add", h.netns)
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
                _ip("link", "set", h.veth, "master", self.bridge, "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run in host ``i``, its host name resolving to 127.0.0.1."""
        return ["ip", "netns", "exec", self.hosts[i].netns, "unshare", "--uts",
                sys.executable, "-c", _AS_LOCALHOST, *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in host ``i`` (``ip netns exec`` and ``unshare`` exec in
        place: the pid is the program's)."""
        p = subprocess.Popen(self.argv(i, argv), **kw)
        self._procs.append(p)
        return p

    def pids(self, i: int) -> list[int]:
        """Every process running in host ``i``."""
        out = _ip("netns", "pids", self.hosts[i].netns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def cut(self, i: int) -> None:
        """Partition host ``i``: its link goes down (no packet passes either way)."""
        _ip("link", "set", self.hosts[i].veth, "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].veth, "up")

    def throttle(self, i: int, rate: str) -> None:
        """Rate-limit host ``i``'s interface (what leaves it) with the kernel's token
        bucket filter, from outside any process of the job."""
        subprocess.run(["ip", "netns", "exec", self.hosts[i].netns, "tc", "qdisc", "add", "dev", "eth0", "root",
                        "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"],
                       check=True, capture_output=True, text=True, timeout=30)

    def unthrottle(self, i: int) -> None:
        subprocess.run(["ip", "netns", "exec", self.hosts[i].netns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                       check=False, capture_output=True, timeout=30)

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for h in self.hosts:
            for _ in range(20):  # whatever our processes started in it (workers)
                pids = self.pids(h.index)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            _ip("netns", "del", h.netns, check=False)
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
