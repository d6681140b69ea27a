"""``initialize(job)`` for a user's own ``pretrain_gpt``-shaped script: the same script
trains stock under ``torchrun`` and resiliently under ``resihp launch``.

::

    from resihp_adapters.megatron_core import initialize

    trainer = initialize(my_job(), config="resihp.toml")
    while (loss := trainer.train_batch()) is not None:
        ...

Under ``resihp launch`` (``RESIHP_STORE`` set by the worker runtime) the job goes to the
adapter and ``train_batch()`` returns once an iteration committed on every live rank,
reconfiguring inside the call; the plan comes from the controller. Under ``torchrun``
the layout and length come from the ResiHP configuration (``config`` or
``$RESIHP_CONFIG``: ``[parallel] tp, pp``, ``[training] microbatches, iterations,
seed``; ``WORLD_SIZE`` must be ``tp x pp x dp``) and :class:`~.stock.StockRun` trains
plain Megatron-Core. Either way ``train_batch()`` returns this rank's share of the global
mean loss (0 off the last stage) and None after the job's last iteration.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from resihp_adapters.megatron_core.spec import MegatronJob

__all__ = ["initialize", "ResilientTrainer", "StockTrainer"]


class ResilientTrainer:
    """The script's handle under ``resihp launch``."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def train_batch(self) -> float | None:
        r = self.worker.step()
        return None if r is None else float(r.loss)

    @property
    def iteration(self) -> int:
        """Iterations committed so far."""
        return self.worker.iteration


class StockTrainer:
    """The script's handle under ``torchrun``: plain Megatron-Core, no ResiHP."""

    def __init__(self, run: Any, iterations: int) -> None:
        self.run, self.iterations = run, iterations

    def train_batch(self) -> float | None:
        if self.run.iteration >= self.iterations:
            return None
        return self.run.train_batch()

    @property
    def iteration(self) -> int:
        return self.run.iteration


def initialize(job: MegatronJob, *, config: str | os.PathLike | None = None) -> ResilientTrainer | StockTrainer:
    """See the module docstring."""
    if not isinstance(job, MegatronJob):
        raise TypeError(f"initialize(job): job is {type(job).__name__}, not a MegatronJob")
    if os.environ.get("RESIHP_STORE"):
        from resihp_core.runtime.worker import Worker

        from resihp_adapters.megatron_core.adapter import MegatronCoreAdapter

        os.environ["RESIHP_INITIALIZED"] = "1"
        worker = Worker.from_env(factory=lambda ctx: MegatronCoreAdapter(ctx, job=job))
        if worker.job.adapter != "megatron_core":
            raise RuntimeError(f"this script trains with megatron_core, the job runs {worker.job.adapter!r}")
        atexit.register(_close_at_exit, worker)
        return ResilientTrainer(worker)
    return _stock(job, config or os.environ.get("RESIHP_CONFIG"))


def _close_at_exit(worker: Any) -> None:
    """Release the adapter's groups if the script ended before the job's stop reached the
    worker (a gloo group left to interpreter shutdown can abort the process)."""
    try:
        worker.adapter.close()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _stock(job: MegatronJob, config: str | os.PathLike | None) -> StockTrainer:
    from resihp_core.config import ConfigError, load_config

    from resihp_adapters.megatron_core.stock import StockRun

    if config is None:
        raise ConfigError("initialize(): under torchrun the layout comes from a ResiHP configuration: pass "
                          "config='resihp.toml' or set RESIHP_CONFIG", path="config")
    cfg = load_config(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp, dp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp
    if world != tp * pp * dp:
        raise ConfigError(f"WORLD_SIZE = {world} processes, the configuration's tp x pp x dp = {tp * pp * dp}",
                          path="parallel", value={"tp": tp, "pp": pp, "dp": dp})
    run = StockRun(job, tp=tp, pp=pp, microbatches=cfg.training.microbatches, seed=cfg.training.seed)
    atexit.register(run.close)
    return StockTrainer(run, cfg.training.iterations)
