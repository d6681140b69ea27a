"""Processes and the wire (DESIGN "Processes and the wire").

* :mod:`.heartbeat` — :class:`~.heartbeat.WorkerClient`, used inside a worker: liveness
  beats with progress and per-iteration profiles to the node agent, from a background
  thread (``beat()`` costs an attribute store).
* :mod:`.agent` — :class:`~.agent.NodeAgent`, one per node: the monitor of its workers
  (:mod:`.node_monitor`, a :class:`~resihp_core.detector.failstop.FailStopMonitor`) and
  their launcher (:mod:`.node_launcher`), with one persistent, authenticated connection
  to the controller. ``python -m resihp_core.runtime.agent``.
* :mod:`.netif` — which interface a node's workers bind their collectives to.
* :mod:`.controller` — :class:`~.controller.Controller`, one per job: aggregates the
  agents' node states, declares fail-stops (including a whole node when its agent's
  connection drops), runs the fail-slow pipeline on the profiles, and emits
  :class:`~resihp_core.protocol.FailureReport` s to a callback and a queue (a job's
  observers hear them from its session). ``python -m resihp_core.runtime.controller``.
* :mod:`.session` — the job session: the one owner of a job's shared state (every
  job-store key behind a typed accessor, the generation counter, verdicts, observers).
* :mod:`.supervisor` / :mod:`.control` — the supervisor's pure state machine (typed
  events in, actions out) and the control loop that feeds it and carries its actions
  out; :mod:`.resilient` wires a whole job; :mod:`.assemble` builds one from its
  configuration (docs/design.md §2.1-2.2).
* :mod:`.launcher` — starting this machine's training workers.
* :mod:`.store` — the authenticated job store (a ``torch.distributed.Store``); :mod:`.gate`
  — bounded resources for connections that have not authenticated yet.
* :mod:`.storehost` / :mod:`.failover` — a job that outlives its controller: the job
  store in a process of its own, the job's authenticated durable state, the
  one-controller lock and the grace timer (docs/failover.md).
* :mod:`.loop` — running an asyncio service on a background thread.
* :mod:`.worker` — the framework-neutral worker (one per device) driving an adapter.

Importing this package imports nothing; import the submodules.
"""

from __future__ import annotations
