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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from resihp_adapters.deepspeed.spec import PipelineSpec, load_ds_config

if TYPE_CHECKING:
    from resihp_core.runtime.worker import Worker

__all__ = ["initialize", "ResilientEngine", "StockEngine"]


class AddressedLoader:
    """What :meth:`ResilientEngine.deepspeed_io` returns: iterated, DeepSpeed's own loader
    of the current plan generation (``engine.deepspeed_io`` there); given to
    ``train_batch(data_iter)`` (bare or in DeepSpeed's ``RepeatingLoader``), the order
    ResiHP reads micro-batches in by address, which is this loader's order on every
    replica (``DistributedSampler(shuffle=True, seed=0)``, :class:`~.data.MicroBatchSource`)."""

    def __init__(self, handle: ResilientEngine, dataset: Any, options: dict[str, Any]) -> None:
        self.handle, self.dataset, self.options = handle, dataset, options

    def __iter__(self) -> Iterator[Any]:
        def batches() -> Iterator[Any]:  # built at the first next(): RepeatingLoader calls iter() at once
            yield from self.handle._engine("deepspeed_io").deepspeed_io(self.dataset, **self.options)

        return batches()

    def __len__(self) -> int:
        return len(self.handle._engine("deepspeed_io").deepspeed_io(self.dataset, **self.options))

    def addressable(self, spec: PipelineSpec) -> str | None:
        """Why ResiHP cannot read this loader's micro-batches by address (None: it can)."""
        from deepspeed.runtime.constants import ROUTE_TRAIN

        o = self.options
        if self.dataset is not spec.dataset:
            return "its dataset is not the one given to initialize(training_data=...)"
        if o.get("route", ROUTE_TRAIN) != ROUTE_TRAIN:
            return f"its route is {o['route']!r}, not training"
        if o.get("data_sampler") is not None:
            return "it has its own data_sampler, which ResiHP cannot address for another replica's micro-batches"
        if o.get("batch_size") not in (None, spec.micro_batch_size):
            return f"its batch_size {o['batch_size']} is not train_micro_batch_size_per_gpu ({spec.micro_batch_size})"
        if o.get("collate_fn") not in (None, spec.collate_fn):
            return "its collate_fn is not the one given to initialize(collate_fn=...)"
        return None


def _ds_callable(name: str) -> bool:
    """Whether ``name`` is a method of DeepSpeed's ``PipelineEngine`` (else an attribute)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return callable(getattr(PipelineEngine, name, None))


class ResilientEngine:
    """The user's handle under ``resihp launch``: answers DeepSpeed's ``PipelineEngine``
    API (:mod:`.surface` lists how each name is answered), each call going to the job or
    to the engine of the current plan generation (rebuilt at every reconfiguration).

    The first plan generation is entered here, as ``deepspeed.initialize`` returns a
    built engine: ``module``, ``stage_id``, ``optimizer``, ``get_lr()`` answer before the
    first ``train_batch()``. Every rank of the job constructs it together (the
    generation's rendezvous)."""

    def __init__(self, worker: Worker, spec: PipelineSpec) -> None:
        object.__setattr__(self, "worker", worker)
        object.__setattr__(self, "spec", spec)
        # None: the stop came before any generation this device runs (then train_batch
        # returns None at once).
        object.__setattr__(self, "_ended", worker.next_iteration() is None)

    # ------------------------------------------------------------------ DeepSpeed's API
    def __getattr__(self, name: str) -> Any:
        from resihp_adapters.deepspeed.surface import DELEGATED, REFUSED, EngineCallRefused, refusal, refused_call

        if name.startswith("__"):
            raise AttributeError(name)
        if name in REFUSED:
            if _ds_callable(name):
                return refused_call(name)
            raise EngineCallRefused(refusal(name))
        if name in DELEGATED:
            return getattr(self._engine(name), name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (nor has DeepSpeed's PipelineEngine)")

    def __setattr__(self, name: str, value: Any) -> None:
        from resihp_adapters.deepspeed.surface import DELEGATED, OWN, REFUSED, EngineCallRefused

        if name in DELEGATED or name in REFUSED or name in OWN:
            raise EngineCallRefused(
                f"engine.{name} = ...: not available under resihp launch: a reconfiguration builds the engine "
                "again from initialize()'s arguments and the DeepSpeed JSON, so the value would be lost silently "
                "(set it there)")
        object.__setattr__(self, name, value)

    def _engine(self, name: str) -> Any:
        """The current generation's engine, or why this rank has none (naming ``name``)."""
        e = self.worker.adapter.engine
        if e is not None:
            return e
        a = self.worker.adapter
        if self._ended:
            why = "the job has ended"
        elif a.plan is None or a.where is None:
            why = "this device is a standby in the current plan generation"
        else:
            why = a.idle_reason(a.plan)
        raise RuntimeError(f"engine.{name}: device {a.ctx.device} runs no DeepSpeed engine now: {why}")

    @property
    def adapter(self) -> Any:
        return self.worker.adapter

    @property
    def current(self) -> Any:
        """The current generation's :class:`~.engine.ResiPipelineEngine` (None on a rank
        that runs nothing in it)."""
        return self.worker.adapter.engine

    def train_batch(self, data_iter: Any = None) -> Any:
        """Train one iteration and return DeepSpeed's aggregated loss (a 0-dim tensor: the
        global mean loss on last-stage ranks, elsewhere the value DeepSpeed broadcasts),
        or None once the job has ended. Micro-batches are read by address from
        ``training_data``, so a user's ``data_iter`` is refused (:mod:`.surface`)."""
        import torch

        self._data_order(data_iter)
        if self._ended:
            return None
        result = self.worker.step()
        if result is None:
            object.__setattr__(self, "_ended", True)
            return None
        e = self.current
        if e is None or not e.is_last_stage():
            # DeepSpeed gives every stage the last stage's loss; a rank idle in this
            # generation or off the last stage reads the committed one (idle.py).
            from resihp_adapters.deepspeed.idle import committed_loss

            w = self.worker
            return torch.tensor(committed_loss(w.store, w.msg.generation, result.iteration, list(w.plan.devices())),
                                dtype=torch.float64)
        loss = self.worker.adapter.last_loss
        if loss is None:
            return None
        agg = getattr(e, "agg_train_loss", None) if e is not None else None
        dtype = agg.dtype if isinstance(agg, torch.Tensor) else torch.float64
        return torch.tensor(loss, dtype=dtype)

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str | None = None,
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
                     num_local_io_workers: int | None = None) -> AddressedLoader:
        """DeepSpeed's ``deepspeed_io``: a loader that iterates as the current generation's
        engine's, and that ``train_batch(data_iter)`` accepts (:class:`AddressedLoader`)."""
        from deepspeed.runtime.constants import ROUTE_TRAIN

        opts = {"batch_size": batch_size, "route": ROUTE_TRAIN if route is None else route,
                "pin_memory": pin_memory, "data_sampler": data_sampler, "collate_fn": collate_fn,
                "num_local_io_workers": num_local_io_workers}
        return AddressedLoader(self, dataset, opts)

    def _data_order(self, data_iter: Any) -> None:
        """Check ``train_batch``'s ``data_iter`` and fix the job's micro-batch order on the
        first call: None reads ``initialize``'s (``shuffle``); a loader of
        :meth:`deepspeed_io` (bare or in a ``RepeatingLoader``) reads that loader's order
        (DeepSpeed's shuffling sampler, seed 0) by address, so a migrated or recovered
        micro-batch is the one DeepSpeed's loader gives that replica. The iterator
        itself is not consumed. Any other iterator is refused with the reason."""
        from deepspeed.runtime.dataloader import RepeatingLoader

        from resihp_adapters.deepspeed.surface import REFUSED, EngineCallRefused

        kind = "initialize"
        if data_iter is not None:
            loader = data_iter.loader if isinstance(data_iter, RepeatingLoader) else data_iter
            why = ("it is not a loader of this engine's deepspeed_io()" if not isinstance(loader, AddressedLoader)
                   or loader.handle is not self else loader.addressable(self.spec))
            if why is not None:
                raise EngineCallRefused(f"engine.train_batch(data_iter): not available under resihp launch for this "
                                        f"iterator ({why}): {REFUSED['set_dataiterator']}")
            kind = "deepspeed_io"
        chosen = self.__dict__.get("_order")
        if chosen is None:
            if kind == "deepspeed_io":
                from resihp_adapters.deepspeed.data import MicroBatchSource

                a = self.worker.adapter
                s = a.source
                a.source = MicroBatchSource(s.dataset, s.collate_fn, s.micro_batch_size, s.num_microbatches,
                                            s.replicas, shuffle=True, seed=0)
            object.__setattr__(self, "_order", kind)
        elif chosen != kind:
            raise EngineCallRefused(f"engine.train_batch: the job reads micro-batches in the order of {chosen}() since "
                                    f"its first step; mixing train_batch() and train_batch(deepspeed_io loader) "
                                    "would change the order mid-job")

    def get_lr(self) -> list[float]:
        """DeepSpeed's ``get_lr()`` of the current generation's engine; on a rank idle in
        this generation (ZeRO 1 / bf16 whole-replica equivalent), the LR its held
        scheduler state gives at the job's step (idle.py), so it is never None."""
        e = self.current
        if e is not None:
            return e.get_lr()
        a = self.worker.adapter
        from resihp_adapters.deepspeed.state import GLOBAL

        held = a._held if GLOBAL in a._held else {GLOBAL: a.idle_global} if a.idle_global is not None else None
        if a.where is not None and held is not None:
            from resihp_adapters.deepspeed.idle import held_lr

            return held_lr(held, self.worker.iteration, self.spec, a.config)
        return self._engine("get_lr").get_lr()  # raises with the reason

    @property
    def iteration(self) -> int:
        return self.worker.iteration

    @property
    def global_steps(self) -> int:
        """Optimizer steps the job has committed (DeepSpeed's ``global_steps``)."""
        return self.worker.iteration

    @property
    def global_samples(self) -> int:
        return self.worker.iteration * self.train_batch_size()

    def train_batch_size(self) -> int:
        """The job's global batch in samples (constant across plan generations)."""
        job = self.worker.job
        return self.spec.micro_batch_size * job.num_microbatches * job.dp

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.spec.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per data shard and iteration, as the DeepSpeed JSON sets them
        (the job's; a generation's engine divides losses by its own count)."""
        return int(self.worker.job.num_microbatches)

    @property
    def micro_batches(self) -> int:
        return self.gradient_accumulation_steps()

    @property
    def micro_batch_size(self) -> int:
        return self.spec.micro_batch_size

    @property
    def training_data(self) -> Any:
        """The dataset given to ``initialize``."""
        return self.spec.dataset

    @property
    def collate_fn(self) -> Any:
        return self.spec.collate_fn

    @property
    def global_rank(self) -> int:
        """This process's rank as the launcher numbered it (stable across generations;
        the rank inside a generation's world is ``current.global_rank``)."""
        return int(os.environ.get("RANK", self.worker.device))

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

    def load_checkpoint(self, load_dir: str, tag: str | None = None,
                        **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint in DeepSpeed's own format (written by plain DeepSpeed or by
        :meth:`save_checkpoint`) into the current generation's engine, on every rank of
        the generation together: everything or nothing (:mod:`.ds_checkpoint`; a
        missing, corrupt or other-model checkpoint raises ``CheckpointNotLoaded`` and
        leaves every rank's state as it was). ResiHP's runtime addresses the data by its
        own iteration, so the checkpoint must be of the step the job stands at (a
        plain-DeepSpeed checkpoint of step k needs the job to start at iteration k,
        which ``resihp launch`` cannot do yet): otherwise refused, before anything loads.
        ``(None, None)`` as DeepSpeed when ``load_dir`` has no ``latest`` file."""
        from resihp_adapters.deepspeed.ds_checkpoint import load_all_or_nothing
        from resihp_adapters.deepspeed.engine import unbounded

        e = self._engine("load_checkpoint")
        self.worker.adapter.check_initial_layout("load_checkpoint")
        with unbounded():
            return load_all_or_nothing(e, load_dir, tag, int(self.iteration), **kwargs)

    def is_last_stage(self) -> bool:
        """True on ranks whose loss is the global mean (DeepSpeed's loss stage)."""
        e = self.current
        return bool(e is not None and e.is_last_stage())

    def is_first_stage(self) -> bool:
        e = self.current
        return bool(e is not None and e.is_first_stage())

    def destroy(self) -> None:
        """DeepSpeed's ``destroy``: :meth:`close`."""
        self.close()

    def close(self) -> None:
        """Release the engine and this generation's process groups (idempotent; also
        run at exit, when the script's loop ends before the job's stop reached it)."""
        self.worker.adapter.close()


class StockEngine:
    """Plain DeepSpeed (no ResiHP runtime): DeepSpeed's engine itself (every other name
    is the engine's own), fed the same addressed micro-batches as under ResiHP when
    ``train_batch()`` gets no iterator."""

    def __init__(self, engine: Any, source: Any) -> None:
        self.engine = engine
        self.iteration = 0
        self._source = source
        self._data = source.iterator(engine.grid.data_parallel_id)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("engine", "_source", "_data", "iteration"):
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        from resihp_adapters.deepspeed.surface import DELEGATED, OWN, REFUSED

        if (name in DELEGATED or name in REFUSED or name in OWN) and self.__dict__.get("engine") is not None:
            setattr(self.engine, name, value)  # DeepSpeed's engine is the one that reads it
        else:
            object.__setattr__(self, name, value)

    @property
    def current(self) -> Any:
        """DeepSpeed's engine (as ``ResilientEngine.current`` is the generation's)."""
        return self.engine

    def train_batch(self, data_iter: Any = None) -> Any:
        """DeepSpeed's ``train_batch``: on ``data_iter`` when given, else on the
        micro-batches ResiHP would read (the same order)."""
        loss = self.engine.train_batch(self._data if data_iter is None else data_iter)
        self.iteration += 1
        return loss

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> tuple[str | None, dict]:
        """DeepSpeed's own ``load_checkpoint``, all or nothing on every rank as under
        ResiHP (:mod:`.ds_checkpoint`), then the data resumes at the loaded step
        (micro-batches are addressed by iteration, as under ResiHP) and so does the
        dropout seed count (``PipelineModule.micro_offset``: forwards run so far)."""
        from resihp_adapters.deepspeed.ds_checkpoint import load_all_or_nothing

        path, client = load_all_or_nothing(self.engine, load_dir, tag, None, **kwargs)
        if path is not None:
            step = int(self.engine.global_steps)
            self.iteration = step
            self._data = self._source.iterator(self.engine.grid.data_parallel_id, start_iteration=step)
            self.engine.module.micro_offset = step * int(self.engine.gradient_accumulation_steps())
        return path, client

    def destroy(self) -> None:
        self.close()

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
    seed_layers: bool = False,
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
    :param seed_layers: ``PipelineModule``'s, with DeepSpeed's default (False): layers
        are built from the process's random state as plain DeepSpeed builds them, so the
        same script starts from the same model under either launcher. True seeds each
        layer (``base_seed`` + its index) and each dropout draw per micro-batch, which a
        model with dropout needs for a recovery to be exact (``docs/deepspeed.md``).
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
                        partition_method=partition_method, seed_layers=bool(seed_layers))
    if os.environ.get("RESIHP_STORE"):
        from resihp_adapters.deepspeed.adapter import DeepSpeedAdapter
        from resihp_core.runtime.worker import Worker

        import gc

        worker = Worker.from_env(factory=lambda ctx: DeepSpeedAdapter(ctx, spec))
        # What is loaded so far lives for the whole process: keep it out of the
        # collections that run when a generation's groups are released.
        gc.freeze()
        handle: ResilientEngine | StockEngine = ResilientEngine(worker, spec)
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

    module = stock_module_class()(spec.layers, num_stages=num_stages, loss_fn=spec.loss_fn, seed_layers=spec.seed_layers,
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
