"""The contracts between ResiHP's parts, in one place (docs/design.md, "Contracts").

- the adapter lifecycle: :class:`~resihp_core.adapter.Adapter` with its
  :class:`~resihp_core.adapter.AdapterContext` and
  :class:`~resihp_core.adapter.Capabilities` (defined in :mod:`resihp_core.adapter`);
- what an adapter reports of a checkpoint write: :class:`CheckpointWrite`;
- what observers hear of each committed iteration: :class:`IterationMetrics`;
- the job's events, typed (:mod:`.events`): what the controller publishes to its one
  sink (:data:`~.events.ControllerEvent`), what the job decides
  (:data:`~.events.JobEvent`), and the union a run's observer hears (:data:`~.events.Event`);
- the job store a worker and the controller share: :class:`KeyValueStore`;
- what ends a job that is not a device's failure: :class:`~resihp_core.protocol.JobError`
  and :class:`~resihp_core.protocol.ScriptEnded` (wire messages, docs/errors.md).

Wire messages (what crosses a socket or the job store) are :mod:`resihp_core.protocol`'s.
Importing this package never imports torch.
"""

from __future__ import annotations

from resihp_core.adapter import Adapter, AdapterContext, Capabilities
from resihp_core.protocol import JobError, ScriptEnded
from resihp_core.protocols.checkpoints import CheckpointWrite
from resihp_core.protocols.events import ControllerEvent, Event, EventLog, JobEvent
from resihp_core.protocols.metrics import IterationMetrics
from resihp_core.protocols.store import KeyValueStore, WatchableStore

__all__ = ["Adapter", "AdapterContext", "Capabilities", "CheckpointWrite", "ControllerEvent", "Event", "EventLog",
           "IterationMetrics", "JobError", "JobEvent", "KeyValueStore", "ScriptEnded", "WatchableStore"]
