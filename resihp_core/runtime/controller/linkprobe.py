"""An active link probe for the fail-slow detector (docs/detector.md, "Slow links").

A link throttled on one host (a rate limit on its interface, a degraded NIC or
switch port) slows every rank that exchanges data with that host's ranks: in a
data-parallel all-reduce or across a pipeline boundary each side waits for the
other, so the time outside compute grows on every rank alike and the profiles alone
cannot say which link it is (``ProfileVerifier``'s ``communication-no-prober`` case).
:class:`NodeLinkProber` answers :meth:`~resihp_core.detector.Prober.probe_links`: the
controller sends ``nbytes`` to each node's agent and times the echo, ``rounds`` times
(the fastest counts), every node at once. A node whose round trip is more than
``slack_s`` above the fastest node's has a slow link; its devices are "behind" it.

It compares hosts with each other, so it needs two nodes or more; on one node it finds
nothing. It times the path between the controller's host and each node, which crosses
the node's own interface in both directions: a rate limit on that interface (either
way) shows. Training is not paused; the probe shares the link with the job's traffic.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Mapping, Sequence

from resihp_core.detector import ProbeResult

if TYPE_CHECKING:
    from resihp_core.runtime.controller import Controller

__all__ = ["NodeLinkProber", "link_result"]


def link_result(node_of: Mapping[int, int], node_s: Mapping[int, float], slack_s: float,
                elapsed_s: float = 0.0) -> ProbeResult:
    """Per-device probe times from per-node round trips: a node within ``slack_s`` of the
    fastest counts as the fastest (timing noise on a loaded host is tens of
    milliseconds; a throttled link is far above it)."""
    times_of = {n: t for n, t in node_s.items() if n in set(node_of.values())}
    if len(times_of) < 2:
        return ProbeResult({}, elapsed_s=elapsed_s)
    ref = max(min(times_of.values()), 1e-6)
    times = {d: (times_of[n] if times_of[n] - ref > slack_s else ref)
             for d, n in node_of.items() if n in times_of}
    return ProbeResult(times, reference=ref, elapsed_s=elapsed_s)


class NodeLinkProber:
    """:class:`~resihp_core.detector.Prober` of each node's link, through its agent.

    :param nbytes: bytes sent each way per round trip (at 20 Mbit/s, 512 KiB takes 0.2 s;
        on a healthy link a few milliseconds).
    :param rounds: round trips per node; the fastest counts.
    :param slack_s: see :func:`link_result`.
    :param timeout_s: one round trip's limit (a node that does not answer is that slow).
    """

    #: It times links only: verification splits a uniformly slow TP group as without a prober.
    measures_compute = False

    def __init__(self, controller: Controller, *, nbytes: int = 512 * 1024, rounds: int = 3,
                 slack_s: float = 0.1, timeout_s: float = 3.0) -> None:
        if nbytes < 1 or rounds < 1 or not slack_s >= 0 or not timeout_s > 0:
            raise ValueError("NodeLinkProber needs nbytes >= 1, rounds >= 1, slack_s >= 0, timeout_s > 0")
        self.controller = controller
        self.nbytes, self.rounds, self.slack_s, self.timeout_s = nbytes, rounds, slack_s, timeout_s

    def probe_compute(self, devices: Sequence[int]) -> ProbeResult:
        """Not measured here (a compute kernel runs on the workers): nothing found."""
        return ProbeResult({})

    def probe_links(self, devices: Sequence[int]) -> ProbeResult:
        """Each device's time is its node's round trip (called from the detector's
        thread; the echo runs on the controller's loop)."""
        loop = self.controller._loop
        node_of = self.controller.node_of(devices)
        if loop is None or len(set(node_of.values())) < 2:
            return ProbeResult({})
        t0 = time.monotonic()
        fut = asyncio.run_coroutine_threadsafe(
            self.controller.echo_nodes(node_of.values(), self.nbytes, self.rounds, self.timeout_s), loop)
        try:
            node_s = fut.result(self.rounds * self.timeout_s + 5.0)
        except Exception:  # noqa: BLE001 - the controller is stopping: nothing measured
            fut.cancel()
            return ProbeResult({})
        return link_result(node_of, node_s, self.slack_s, time.monotonic() - t0)
