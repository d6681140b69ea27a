"""``initialize``: a user's DeepSpeed pipeline script made resilient by one call.

The script keeps DeepSpeed's ingredients (``LayerSpec`` layers, a loss, a torch
optimizer, the DeepSpeed JSON config) and gives its data as a map-style dataset with a
collate function. Where ``deepspeed.initialize`` took a built ``PipelineModule``, this
takes the module's layers (ResiHP builds the module again for every plan generation).

- Started by ``resihp launch`` (``RESIHP_STORE`` set): the returned engine's
  :meth:`ResilientEngine.train_batch` runs one iteration through the worker runtime
  (``resihp_core.runtime.worker.Worker.step``): it returns once the iteration has
  committed on every live rank, rebuilding the engine inside the call when the plan
  changes; a rank the plan leaves out waits inside it as a standby; at the job's end it
  returns None.
- Started any other way (``accelerate launch``, ``deepspeed``, ``torchrun``): stock
  ``deepspeed.initialize`` with a ``PipelineModule`` of the same layers, fed the same
  addressed micro-batches. Nothing survives a failure there.

Either way the engine is closed when the script's process exits (``atexit``): its
process groups are destroyed while the interpreter is still whole. Left to interpreter
shutdown, a gloo worker thread could drop its last reference to the tensors of the final
collective after Python had started tearing down, and the process died with SIGABRT
("terminate called without an active exception") after training had finished, which
under ``accelerate launch`` fails the whole job (``docs/deepspeed.md``).
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Callable, Sequence

from resihp_adapters.deepspeed.spec import PipelineSpec, load_ds_config

__all__ = ["initialize", "ResilientEngine", "StockEngine"]


class ResilientEngine:
    """The user's handle under ``resihp launch``: behaves like DeepSpeed's
    ``PipelineEngine`` for what pipeline scripts call (``train_batch``, ``module``,
    ``global_rank``, ``get_lr``, ``is_last_stage``, ...), each call going to the engine
    of the current plan generation (rebuilt at every reconfiguration)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    @property
    def adapter(self) -> Any:
        return self.worker.adapter

    @property
    def current(self) -> Any:
        """The current generation's :class:`~.engine.ResiPipelineEngine` (None on a rank
        that runs nothing in it)."""
        return self.worker.adapter.engine

    def train_batch(self, data_iter: Any = None) -> float | None:
        """Train one iteration; its global mean loss (on last-stage ranks; elsewhere the
        value DeepSpeed broadcasts), or None once the job has ended. ``data_iter`` is
        ignored: micro-batches are read by address from ``training_data``."""
        r = self.worker.step()
        if r is None:
            return None
        return self.worker.adapter.last_loss

    @property
    def iteration(self) -> int:
        return self.worker.iteration

    @property
    def global_steps(self) -> int:
        return self.worker.iteration

    @property
    def module(self) -> Any:
        """This rank's ``PipelineModule`` of the current generation."""
        e = self.current
        return e.module if e is not None else None

    @property
    def global_rank(self) -> int:
        """This process's rank as the launcher numbered it (stable across generations;
        the rank inside a generation's world is ``current.global_rank``)."""
        return int(os.environ.get("RANK", self.worker.device))

    def get_lr(self) -> list[float] | None:
        """The learning rate per parameter group (None on a rank that runs nothing now)."""
        e = self.current
        return e.get_lr() if e is not None else None

    def full_state(self) -> dict[str, Any]:
        """DeepSpeed's complete state of this rank by layout-independent names
        (:meth:`~.adapter.DeepSpeedAdapter.full_state`)."""
        return self.worker.adapter.full_state()

    def eval_batch(self, data_iter: Any, **kwargs: Any) -> Any:
        """DeepSpeed's ``eval_batch`` on the current generation's engine (its inference
        schedule over this rank's replica, ``data_iter`` as DeepSpeed reads it). Every
        rank of the generation calls it; it is not made resilient: a peer dying during it
        raises here. None on a rank that runs nothing in this generation."""
        from resihp_adapters.deepspeed.engine import unbounded

        e = self.current
        if e is None:
            return None
        with unbounded():  # every rank finishes it, also after the job's stop
            return e.eval_batch(data_iter, **kwargs)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True) -> bool:
        """DeepSpeed's own checkpoint (``layer_XX-model_states.pt``,
        ``mp_rank_XX_model_states.pt``, ZeRO's ``*_optim_states.pt``, ``latest``),
        written by the current generation's engine, so plain DeepSpeed loads it
        (``engine.load_checkpoint``) and trains on. Every rank of the generation calls
        it, as DeepSpeed's. DeepSpeed's files describe one layout, so this is refused
        once the job runs another split than its initial one (``docs/deepspeed.md``).
        ResiHP's own checkpoints (``checkpoint_every``) are separate and load onto any
        layout. A rank idle in this generation writes nothing."""
        e = self.current
        if e is None:
            return True
        from resihp_adapters.deepspeed.engine import unbounded

        self.worker.adapter.check_initial_layout("save_checkpoint")
        with unbounded():
            return bool(e.save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                          save_latest=save_latest))

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> tuple[str | None, dict]:
        """Load a checkpoint in DeepSpeed's own format (written by plain DeepSpeed or by
        :meth:`save_checkpoint`) into the current generation's engine. ResiHP's runtime
        addresses the data by its own iteration, so the checkpoint must be of the step
        the job stands at (a plain-DeepSpeed checkpoint of step k needs the job to start
        at iteration k, which ``resihp launch`` cannot do yet): otherwise refused."""
        e = self.current
        if e is None:
            raise RuntimeError("load_checkpoint: this rank runs nothing in the current plan generation")
        from resihp_adapters.deepspeed.engine import unbounded

        self.worker.adapter.check_initial_layout("load_checkpoint")
        with unbounded():
            path, client = e.load_checkpoint(load_dir, tag=tag, **kwargs)
        if path is not None and int(e.global_steps) != int(self.iteration):
            raise RuntimeError(f"load_checkpoint: {path} is of step {e.global_steps}, the job stands at iteration "
                               f"{self.iteration}; ResiHP resumes a job only where its runtime stands")
        return path, client

    def is_last_stage(self) -> bool:
        """True on ranks whose loss is the global mean (DeepSpeed's loss stage)."""
        e = self.current
        return bool(e is not None and e.is_last_stage())

    def is_first_stage(self) -> bool:
        e = self.current
        return bool(e is not None and e.is_first_stage())

    def close(self) -> None:
        """Release the engine and this generation's process groups (idempotent; also
        run at exit, when the script's loop ends before the job's stop reached it)."""
        self.worker.adapter.close()

class StockEngine:
    """Plain DeepSpeed (no ResiHP runtime): the same interface, the same data order."""

    def __init__(self, engine: Any, source: Any) -> None:
        self.engine = engine
        self.iteration = 0
        self._source = source
        self._data = source.iterator(engine.grid.data_parallel_id)

    def is_last_stage(self) -> bool:
        return bool(self.engine.is_last_stage())

    def is_first_stage(self) -> bool:
        return bool(self.engine.is_first_stage())

    @property
    def module(self) -> Any:
        return self.engine.module

    @property
    def global_rank(self) -> int:
        return int(self.engine.global_rank)

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def train_batch(self) -> float:
        loss = self.engine.train_batch(self._data)
        self.iteration += 1
        return float(loss)

    def eval_batch(self, data_iter: Any, **kwargs: Any) -> Any:
        """DeepSpeed's own ``eval_batch``."""
        return self.engine.eval_batch(data_iter, **kwargs)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True) -> bool:
        """DeepSpeed's own ``save_checkpoint``."""
        return bool(self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                                save_latest=save_latest))

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> tuple[str | None, dict]:
        """DeepSpeed's own ``load_checkpoint``, then the data resumes at the loaded step
        (micro-batches are addressed by iteration, as under ResiHP) and so does the
        dropout seed count (``PipelineModule.micro_offset``: forwards run so far)."""
        path, client = self.engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        if path is not None:
            step = int(self.engine.global_steps)
            self.iteration = step
            self._data = self._source.iterator(self.engine.grid.data_parallel_id, start_iteration=step)
            self.engine.module.micro_offset = step * int(self.engine.gradient_accumulation_steps())
        return path, client

    def close(self) -> None:
        """Break the engine apart and destroy every process group (idempotent; run at
        exit): the gloo worker threads are joined before the interpreter shuts down."""
        from resihp_adapters.deepspeed.world import dismantle, teardown_world

        engine, self.engine = self.engine, None
        if engine is None:
            return
        self._data = None
        dismantle(engine)
        del engine
        teardown_world()


def initialize(
    layers: Sequence[Any],
    *,
    loss_fn: Callable[..., Any] | None = None,
    optimizer: Any = None,
    config: Any = None,
    training_data: Any,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    base_seed: int = 1234,
    num_stages: int | None = None,
    lr_scheduler: Callable[[Any], Any] | None = None,
    activation_checkpoint_interval: int = 0,
    checkpointable_layers: list[str] | None = None,
    shuffle: bool = False,
    data_seed: int = 0,
    partition_method: str = "uniform",
) -> ResilientEngine | StockEngine:
    """ResiHP's stand-in for ``deepspeed.initialize`` (see the module docstring).

    :param layers: the ``PipelineModule``'s layers (``LayerSpec``s).
    :param optimizer: a torch optimizer (rebuilt with the same class and settings), a
        factory ``params -> optimizer``, or None (the DeepSpeed config's).
    :param config: DeepSpeed config dict or JSON path; None: the file accelerate names
        (``ACCELERATE_DEEPSPEED_CONFIG_FILE``). Its ``resihp`` section is ResiHP's.
    :param training_data: a map-style dataset; ``collate_fn`` makes ``(inputs, labels)``.
    :param num_stages: pipeline stages for a stock launch (default: ``resihp.pp``, 2).
    :param lr_scheduler: a factory ``optimizer -> scheduler`` (as DeepSpeed accepts);
        None: the DeepSpeed config's ``scheduler``, if any. Its state is carried across
        reconfigurations.
    :param activation_checkpoint_interval, checkpointable_layers: as ``PipelineModule``'s.
    :param partition_method: ``PipelineModule``'s initial split (``"uniform"``,
        ``"parameters"``, ``"type:<regex>"``), computed by DeepSpeed's own code either
        way; under ``resihp launch`` the first plan takes it (the launcher learns it from
        a probe run of the script, :mod:`.partition`) and the Scheduler repartitions from
        there (``docs/deepspeed.md``).
    :param shuffle, data_seed: False: the order of the pipeline engine's own
        ``training_data`` loader; True: the order ``engine.deepspeed_io(dataset)`` gives
        (a shuffling ``DistributedSampler`` with seed ``data_seed``). Either way every
        micro-batch is addressed by (iteration, replica, micro-batch).
    """
    from resihp_adapters.deepspeed.partition import PROBE_ENV, check_partition_method

    partition_method = check_partition_method(partition_method)
    probe = os.environ.get(PROBE_ENV)
    if probe:  # the launcher's probe run: DeepSpeed's split of these layers, then exit
        from resihp_adapters.deepspeed.partition import write_probe

        write_probe(probe, list(layers), partition_method)
        raise SystemExit(0)
    cfg = load_ds_config(config)
    spec = PipelineSpec(layers=list(layers), config=cfg, dataset=training_data, loss_fn=loss_fn,
                        collate_fn=collate_fn, optimizer=optimizer, base_seed=base_seed, lr_scheduler=lr_scheduler,
                        activation_checkpoint_interval=activation_checkpoint_interval,
                        checkpointable_layers=checkpointable_layers, shuffle=shuffle, data_seed=data_seed,
                        partition_method=partition_method)
    if os.environ.get("RESIHP_STORE"):
        from resihp_adapters.deepspeed.adapter import DeepSpeedAdapter
        from resihp_core.runtime.worker import Worker

        import gc

        worker = Worker.from_env(factory=lambda ctx: DeepSpeedAdapter(ctx, spec))
        # What is loaded so far lives for the whole process: keep it out of the
        # collections that run when a generation's groups are released.
        gc.freeze()
        handle: ResilientEngine | StockEngine = ResilientEngine(worker)
    else:
        handle = _stock(spec, num_stages or int(spec.resihp.get("pp", 2)), partition_method)
    atexit.register(handle.close)
    return handle


def _stock(spec: PipelineSpec, num_stages: int, partition_method: str = "uniform") -> StockEngine:
    import deepspeed
    import torch
    from resihp_adapters.deepspeed.data import MicroBatchSource
    from resihp_adapters.deepspeed.world import prepare_deepspeed

    prepare_deepspeed(float(spec.resihp.get("timeout_s", 600)))
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    from resihp_adapters.deepspeed.spec import torch_optimizer_config

    from resihp_adapters.deepspeed.partition import stock_module_class

    module = stock_module_class()(spec.layers, num_stages=num_stages, loss_fn=spec.loss_fn, seed_layers=True,
                            base_seed=spec.base_seed, partition_method=partition_method,
                            activation_checkpoint_interval=spec.activation_checkpoint_interval,
                            checkpointable_layers=spec.checkpointable_layers)
    opt = spec.optimizer
    if opt is not None and not isinstance(opt, torch.optim.Optimizer):
        opt = opt([p for p in module.parameters() if p.requires_grad])
    cfg = torch_optimizer_config(spec.config, log=lambda m: print(f"resihp: {m}", flush=True))
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg, lr_scheduler=spec.lr_scheduler)
    if any(p.dtype == torch.float64 for p in module.parameters()):
        engine.communication_data_type = torch.float64
    dp = engine.grid.data_parallel_size
    source = MicroBatchSource(spec.dataset, spec.collate_fn or MicroBatchSource.default_collate,
                              spec.micro_batch_size, engine.gradient_accumulation_steps(), dp,
                              shuffle=spec.shuffle, seed=spec.data_seed)
    return StockEngine(engine, source)
