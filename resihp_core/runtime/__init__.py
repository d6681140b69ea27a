"""Processes and the wire (DESIGN "Processes and the wire"), grouped by the process
each part runs in.

* :mod:`.controller` — the controller process, one per job.
  :class:`~.controller.Controller` (the package itself) aggregates the agents' node
  states, declares fail-stops (including a whole node when its agent's connection
  drops), runs the fail-slow pipeline on the profiles and publishes what it learns to
  one sink (:mod:`resihp_core.protocols.events`). Beside it: the supervisor's pure state
  machine (:mod:`.controller.supervisor`) and the control loop that feeds it and carries
  its actions out (:mod:`.controller.control`), the payback rule
  (:mod:`.controller.payback`), the composition root of a job
  (:mod:`.controller.resilient`, :class:`~.controller.resilient.ResilientJob`), its
  settings (:mod:`.controller.runconfig`) and assembly from a configuration
  (:mod:`.controller.assemble`), the job's workers as the controller steers them
  (:mod:`.controller.launcher`), the console and run log (:mod:`.controller.console`),
  link probes through the agents (:mod:`.controller.linkprobe`), report phases
  (:mod:`.controller.jobs`) and the job store's own process for a job that outlives its
  controller (:mod:`.controller.storehost`). ``python -m resihp_core.runtime.controller``.
* :mod:`.agent` — the node agent process, one per node: :class:`~.agent.NodeAgent`, the
  monitor of its workers (:mod:`.agent.node_monitor`) and their launcher
  (:mod:`.agent.node_launcher`), with one persistent, authenticated connection to the
  controller. ``python -m resihp_core.runtime.agent``.
* :mod:`.worker` — the worker process, one per device: the framework-neutral
  :class:`~.worker.Worker` driving an adapter, and its fault injector
  (:mod:`.worker.injector`). ``python -m resihp_core.runtime.worker``.

Shared by them:

* :mod:`.session` — the job session: the one owner of a job's shared state (every
  job-store key behind a typed accessor, the generation counter, verdicts, observers).
* :mod:`.store` — the authenticated job store (a ``torch.distributed.Store``); :mod:`.gate`
  — bounded resources for connections that have not authenticated yet.
* :mod:`.heartbeat` — :class:`~.heartbeat.WorkerClient`, used inside a worker: liveness
  beats with progress and per-iteration profiles to the node agent, from a background
  thread (``beat()`` costs an attribute store).
* :mod:`.processes` — where worker processes run and how they are started (locally or by
  the agents) and reaped.
* :mod:`.failover` — a job that outlives its controller: its authenticated durable
  state, the one-controller lock and the grace timer (docs/failover.md).
* :mod:`.netif` — which interface a node's workers bind their collectives to.
* :mod:`.loop` — running an asyncio service on a background thread.

Importing this package imports nothing; import the subpackages and modules.
"""

from __future__ import annotations
