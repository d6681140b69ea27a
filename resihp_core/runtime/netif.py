"""Which network interface a node's workers bind their collectives to.

Gloo (and NCCL's bootstrap) pick an address from the host name unless told an
interface; on many images and containers the host name resolves to ``127.0.0.1``, so
a worker would advertise a loopback address to peers on other hosts and every
connection to it is refused. A node agent therefore tells its workers an interface
explicitly, by default the one carrying the local address of its own connection to
the controller (an address the other hosts demonstrably route to), or the one the user
names (``runtime.interface`` / ``--interface``: an interface name or one of its
addresses). See docs/multihost.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["Interface", "interface_addresses", "select_interface", "collective_env", "is_loopback",
           "check_collective_addresses", "INTERFACE_ENV"]

INTERFACE_ENV = "RESIHP_INTERFACE"  # the user's choice, carried to agents in LaunchWorkers.env
COLLECTIVE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Interface:
    """A network interface and the address workers bind to on it."""

    name: str
    address: str

    @property
    def loopback(self) -> bool:
        return is_loopback(self.address)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return address == "localhost"


class _SockAddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_IfAddrs)), ("ifa_name", ctypes.c_char_p), ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_SockAddr)), ("ifa_netmask", ctypes.POINTER(_SockAddr)),
    ("ifa_ifu", ctypes.POINTER(_SockAddr)), ("ifa_data", ctypes.c_void_p),
]


def interface_addresses() -> dict[str, list[str]]:
    """Every interface of this network namespace with its IPv4 and IPv6 addresses
    (``getifaddrs``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out: dict[str, list[str]] = {}
    try:
        p = head
        while p:
            ifa = p.contents
            name = ifa.ifa_name.decode(errors="replace")
            out.setdefault(name, [])
            if ifa.ifa_addr:
                fam = ifa.ifa_addr.contents.sa_family
                raw = ctypes.string_at(ifa.ifa_addr, 28)
                if fam == socket.AF_INET:
                    out[name].append(socket.inet_ntop(socket.AF_INET, raw[4:8]))
                elif fam == socket.AF_INET6:
                    out[name].append(socket.inet_ntop(socket.AF_INET6, raw[8:24]))
            p = ifa.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


def _same(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.split("%", 1)[0]) == ipaddress.ip_address(b.split("%", 1)[0])
    except ValueError:
        return False


def select_interface(choice: str | None = None, *, local_address: str | None = None,
                     environ: Mapping[str, str] = os.environ,
                     addresses: Mapping[str, Iterable[str]] | None = None) -> Interface | None:
    """The interface workers bind to, in this order: ``choice`` (an interface name or an
    address of this host; ValueError when it is neither), ``GLOO_SOCKET_IFNAME`` already
    set in ``environ``, the interface carrying ``local_address`` (the agent's end of its
    controller connection). None when none applies (e.g. a Unix-socket controller)."""
    table = {k: list(v) for k, v in (addresses if addresses is not None else interface_addresses()).items()}

    def by_name(name: str, what: str) -> Interface:
        if name not in table:
            raise ValueError(f"{what}: no interface {name!r} on this host (it has {sorted(table)})")
        addrs = table[name]
        v4 = [a for a in addrs if ":" not in a]
        if not addrs:
            raise ValueError(f"{what}: interface {name!r} has no address")
        return Interface(name, (v4 or addrs)[0])

    def by_address(addr: str, what: str) -> Interface | None:
        for name, addrs in table.items():
            for a in addrs:
                if _same(a, addr):
                    return Interface(name, a)
        if what:
            raise ValueError(f"{what}: {addr!r} is neither an interface nor an address of this host "
                             f"(interfaces: {sorted(table)})")
        return None

    if choice:
        choice = choice.strip()
        if choice in table:
            return by_name(choice, "interface")
        return by_address(choice, "interface")
    env = environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if env:
        return by_name(env, "GLOO_SOCKET_IFNAME")
    if local_address:
        return by_address(local_address, "")
    return None


def collective_env(iface: Interface, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Worker environment that binds gloo and NCCL's sockets to ``iface`` (a variable the
    user already set is kept) and names the address (``RESIHP_HOST_ADDR``) for any
    other listener a worker opens."""
    out = {k: iface.name for k in COLLECTIVE_ENV if not environ.get(k)}
    out["RESIHP_HOST_ADDR"] = iface.address
    return out


def check_collective_addresses(addresses: Mapping[int, str], node_of: Mapping[int, int]) -> None:
    """Raise ValueError when a multi-host job would hand peers a loopback address:
    some node's workers bind to loopback while other nodes' bind to routable addresses
    (so those nodes are on other hosts and can never connect to them)."""
    by_node: dict[int, set[str]] = {}
    for d, a in addresses.items():
        if a:
            by_node.setdefault(node_of.get(d, -1), set()).add(a)
    loop = sorted(n for n, a in by_node.items() if any(is_loopback(x) for x in a))
    remote = sorted(n for n, a in by_node.items() if any(not is_loopback(x) for x in a))
    if loop and remote:
        where = ", ".join(f"node {n}: {sorted(by_node[n])[0]}" for n in remote[:4])
        raise ValueError(
            f"node(s) {loop} would give their peers the loopback address {sorted(by_node[loop[0]])[0]} for "
            f"collectives, but node(s) {remote} are on other hosts ({where}): their workers cannot reach it. "
            "Point every agent at an address of the controller the other hosts reach (not 127.0.0.1), "
            "or set runtime.interface / 'resihp agent --interface' to the interface or address to use.")
