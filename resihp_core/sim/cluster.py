"""The simulated job: model, cluster and the stated costs of every reaction.

Why: the cluster simulator (:mod:`resihp_core.sim`) must price a job the way the
planner prices plans, so it builds its job with the planner's own
:func:`~resihp_core.sim.jobs.job_state` (analytic per-layer costs from FLOPs,
the α·N + β·Σl² workload term on the long-tailed corpus, optimizer and DP reduction
from bandwidth, nodes of 8 devices, NVSwitch inside, 200 Gb/s between) and judges
every plan with the planner's :class:`~resihp_core.scheduler.evaluate.Evaluator`
(the DAG simulator). Nothing here re-implements iteration time.

:class:`Costs` holds the time of each reaction that is not an iteration. Each field
names its source; all are overridable (a scenario file or the API may set them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from resihp_core.sim.jobs import MODELS, ModelSpec

__all__ = ["ALL_MODELS", "Costs", "JobSpec", "SimError", "STANDARD_JOBS"]


class SimError(ValueError):
    """Bad simulator input; the message names the field at fault."""


#: docs/design.md §7's model scales: the planner's LLaMA shapes plus Qwen-2.5 (layers, hidden,
#: parameters per layer from the published configurations, embeddings excluded).
ALL_MODELS: dict[str, ModelSpec] = {
    **MODELS,
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 233e6, 28),
    "qwen2.5-14b": ModelSpec("qwen2.5-14b", 48, 5120, 275e6, 40),
    "qwen2.5-32b": ModelSpec("qwen2.5-32b", 64, 5120, 488e6, 40),
}


@dataclass(frozen=True)
class JobSpec:
    """One training job: model and (tp, pp, dp) layout, ``num_microbatches`` per replica."""

    model: str = "llama2-7b"
    tp: int = 4
    pp: int = 2
    dp: int = 2
    num_microbatches: int = 16
    tokens: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in ALL_MODELS:
            raise SimError(f"job.model: unknown model {self.model!r} (one of {', '.join(ALL_MODELS)})")
        for name in ("tp", "pp", "dp", "num_microbatches", "tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SimError(f"job.{name} must be an int >= 1, got {v!r}")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        """Samples (packed micro-batches of ``tokens`` tokens) per iteration."""
        return self.dp * self.num_microbatches

    def spec(self) -> ModelSpec:
        return ALL_MODELS[self.model]

    def state(self, effort: str = "auto") -> Any:
        """The planner's healthy :class:`~resihp_core.scheduler.PlannerState` of this job."""
        from dataclasses import replace

        from resihp_core.sim.jobs import job_state

        st = job_state(tp=self.tp, pp=self.pp, dp=self.dp, num_microbatches=self.num_microbatches,
                       model=self.spec(), tokens=self.tokens, seed=self.seed)
        return replace(st, effort=effort)

    def state_bytes_per_layer(self) -> float:
        """Parameters + gradients + Adam state of one layer (16 bytes per parameter,
        mixed precision: the planner's memory model)."""
        return 16.0 * self.spec().params_per_layer

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise SimError(f"job: unknown field(s) {bad} (known: {sorted(known)})")
        return cls(**d)


#: docs/design.md §7's scales (devices -> job).
STANDARD_JOBS: dict[int, JobSpec] = {
    16: JobSpec("llama2-7b", 4, 2, 2, 16),
    32: JobSpec("llama2-13b", 4, 4, 2, 16),
    64: JobSpec("llama-30b", 4, 8, 2, 32),
    256: JobSpec("llama2-70b", 4, 16, 4, 64),
    16384: JobSpec("llama2-70b", 8, 16, 128, 64),
    131072: JobSpec("llama2-70b", 8, 16, 1024, 64),
}


@dataclass(frozen=True)
class Costs:
    """Seconds (or bytes/s) of everything a reaction costs besides iterations.

    Sources, in order:

    - ``heartbeat_detect_s``: fail-stop detection, heartbeat interval x missed beats of
      :class:`~resihp_core.config.DetectorConfig` (0.1 s x 3), rounded up to 1 s for a
      remote node agent.
    - ``planning_s``, ``planning_16k_s``, ``planning_128k_s``: the planner's measured
      latency (``benchmarks/scheduler.py``, the stages and the peer moves: ~0.1 s at 256
      devices; at 16,384 0.2 s of CPU, 0.4-0.9 s wall on a loaded 2-core machine; at
      131,072 0.8-0.9 s of CPU), rounded up; scaled linearly in devices between those
      points by :meth:`planning`.
    - ``rebuild_s``: communicator rebuild of one plan generation (NCCL communicator
      init at scale is seconds; gloo here takes ~1 s: ENVIRONMENT notes).
    - ``state_bandwidth``: bytes/s one device receives when layers move between
      devices (one 200 Gb/s InfiniBand NIC per GPU: 25 GB/s).
    - ``restart_s``: relaunching every process and re-initialising the framework and
      communicators after a crash (minutes on large jobs; 120 s is a conservative
      figure for a scheduler requeue on warm nodes).
    - ``reload_bandwidth``: bytes/s per device reading its checkpoint shard from shared
      storage (2 GB/s).
    - ``checkpoint_interval_s``: checkpoint period of the job (30 min of job time).
    - ``verify_s``: one verification of a suspected fail-slow (profiling/probing
      iterations) that finds nothing: the price of a false alarm.
    - ``reprobe_s``: how often an excluded slow device is probed to see whether it
      recovered.
    """

    heartbeat_detect_s: float = 1.0
    planning_s: float = 0.1
    planning_16k_s: float = 0.5
    planning_128k_s: float = 1.0
    rebuild_s: float = 5.0
    state_bandwidth: float = 25e9
    restart_s: float = 120.0
    reload_bandwidth: float = 2e9
    checkpoint_interval_s: float = 1800.0
    verify_s: float = 2.0
    reprobe_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise SimError(f"costs.{f.name} must be a finite number >= 0, got {v!r}")
        for name in ("state_bandwidth", "reload_bandwidth", "checkpoint_interval_s"):
            if getattr(self, name) <= 0:
                raise SimError(f"costs.{name} must be > 0")

    def planning(self, devices: int) -> float:
        """Planning seconds for a job of ``devices`` devices (see the class docs)."""
        if devices <= 256:
            return self.planning_s
        if devices <= 16384:
            frac = (devices - 256) / (16384 - 256)
            return self.planning_s + frac * (self.planning_16k_s - self.planning_s)
        frac = min(1.0, (devices - 16384) / (131072 - 16384))
        return self.planning_16k_s + frac * (self.planning_128k_s - self.planning_16k_s)

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise SimError(f"costs: unknown field(s) {bad} (known: {sorted(known)})")
        return cls(**d)
