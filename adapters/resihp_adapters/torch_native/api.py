"""``initialize``: a training script that runs under plain ``accelerate launch`` (or
``torchrun``) and, unchanged, under ``resihp launch``.

- Started by ``resihp launch`` (``RESIHP_STORE`` set): the job is the controller's
  (assembled from the ResiHP configuration by :mod:`.launch`); the returned trainer's
  :meth:`ResilientTrainer.train_batch` runs one iteration through the worker runtime
  (``resihp_core.runtime.worker.Worker.step``): it returns once the iteration has
  committed on every live rank, rebuilding world, meshes, stages and FSDP wrappers inside
  the call when the plan changes; a rank the plan leaves out waits inside it as a
  standby; at the job's end it returns None.
- Started any other way: :class:`~.reference.StockPipeline` — ``fully_shard`` stages in a
  stock ``Schedule1F1B`` / ``ScheduleGPipe`` over the default group torchrun set up,
  trained on the same job data, the same number of iterations. Nothing survives a
  failure there.

Both read the same ResiHP configuration (``config``, else ``$RESIHP_CONFIG`` for a plain launch), whose
``[model]`` is the adapter's LLaMA (:mod:`.model`).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["initialize", "ResilientTrainer", "StockTrainer"]


class ResilientTrainer:
    """The user's handle under ``resihp launch``: ``train_batch()`` per iteration."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def train_batch(self) -> float | None:
        """Train one iteration; this rank's share of the global loss (its replica's
        micro-batches, on the last stage; 0 elsewhere), or None once the job has ended."""
        r = self.worker.step()
        return None if r is None else float(r.loss)

    @property
    def iteration(self) -> int:
        """Iterations committed so far."""
        return self.worker.iteration

    def is_last_stage(self) -> bool:
        e = self.worker.adapter.engine
        return e.place is not None and e.place.stage == e.plan.pp - 1


class StockTrainer:
    """Plain torch (no ResiHP runtime): the same interface, the same data."""

    def __init__(self, pipeline: Any, iterations: int) -> None:
        self.pipeline = pipeline
        self.iterations = iterations

    def train_batch(self) -> float | None:
        if self.pipeline.iteration >= self.iterations:
            return None
        return self.pipeline.step()

    @property
    def iteration(self) -> int:
        return self.pipeline.iteration

    def is_last_stage(self) -> bool:
        return self.pipeline.is_last_stage


def initialize(config: str | os.PathLike | None = None) -> ResilientTrainer | StockTrainer:
    """See the module docstring. ``config``: the ResiHP configuration file for a plain
    launch (default ``$RESIHP_CONFIG``); under ``resihp launch`` the job's own is used."""
    if os.environ.get("RESIHP_STORE"):
        import gc

        from resihp_core.runtime.worker import Worker

        worker = Worker.from_env()
        if worker.job.adapter != "torch_native":
            raise RuntimeError(f"this script trains with torch_native, the job runs {worker.job.adapter!r}")
        # What is loaded so far lives for the whole process: keep it out of the
        # collections that run when a generation's groups are released.
        gc.freeze()
        return ResilientTrainer(worker)
    return _stock(config or os.environ.get("RESIHP_CONFIG"))


def _stock(config: str | os.PathLike | None) -> StockTrainer:
    import datetime

    import torch
    import torch.distributed as dist

    from resihp_core.data import create_source

    from resihp_adapters.torch_native.adapter import parse_config
    from resihp_adapters.torch_native.data import Batches
    from resihp_adapters.torch_native.launch import settings
    from resihp_adapters.torch_native.plugin import job_section
    from resihp_adapters.torch_native.reference import StockPipeline

    if not config:
        raise RuntimeError("initialize(): name the ResiHP configuration file (initialize('resihp.toml') or "
                           "RESIHP_CONFIG=...): it holds the model, the data and the pipeline depth")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    cfg = settings(config, processes=dist.get_world_size())
    tr = cfg.training
    # The job resihp launch would run: the adapter's section and the [data] source.
    c = parse_config(job_section(cfg), tr.seed)
    source = create_source(cfg.data.section(), dp=cfg.parallel.dp, num_microbatches=tr.microbatches, seed=tr.seed,
                           token_budget=tr.token_budget, vocab_size=cfg.model.vocab)
    data = Batches(source, c["model"].torch_dtype)
    pipeline = StockPipeline(c["model"], data, pp=cfg.parallel.pp, num_microbatches=tr.microbatches,
                             shard=c["shard"], lr=c["lr"], weight_decay=c["weight_decay"],
                             schedule=cfg.scheduler.schedule)
    return StockTrainer(pipeline, tr.iterations)
