"""``initialize``: a training script that runs under plain ``accelerate launch`` (or
``torchrun``) and, unchanged, under ``resihp launch``.

The script brings its own model, optimizer, LR scheduler, loss, clipping and data
(``initialize(model, optimizer=..., lr_scheduler=..., dataset=..., ...)``; see
docs/torch_native.md, "Your model"), or names only a ResiHP configuration to train the
adapter's own LLaMA on the job's data source (``initialize("resihp.toml")``).

- Started by ``resihp launch`` (``RESIHP_STORE`` set): the job is the controller's
  (assembled from the ResiHP configuration by :mod:`.launch`); the returned trainer's
  :meth:`ResilientTrainer.train_batch` runs one iteration through the worker runtime
  (``resihp_core.runtime.worker.Worker.step``): it returns once the iteration has
  committed on every live rank, rebuilding world, meshes, stages and FSDP wrappers inside
  the call when the plan changes; a rank the plan leaves out waits inside it as a
  standby; at the job's end it returns None.
- Started any other way: :class:`~.reference.StockPipeline` — ``fully_shard`` stages in a
  stock ``Schedule1F1B`` / ``ScheduleGPipe`` over the default group torchrun set up,
  trained on the same data, the same number of iterations. Nothing survives a failure
  there.

Both read the same ResiHP configuration (``config``, else ``$RESIHP_CONFIG`` for a plain
launch): pipeline depth, micro-batches per replica, iterations, FSDP shard degree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from resihp_adapters.torch_native.loop import Iteration
    from resihp_adapters.torch_native.data import UserData
    from resihp_adapters.torch_native.engine import Recipe
    from resihp_adapters.torch_native.split import UserStages

__all__ = ["initialize", "ResilientTrainer", "StockTrainer", "UserJob", "user_job"]


class _Modes:
    """One way of training per job: ``train_batch()`` (ResiHP's schedule runs the
    micro-batches) or ``iterations()`` (the user's loop, :mod:`.loop`), not both."""

    _mode: str | None = None

    def _use(self, mode: str) -> None:
        if self._mode not in (None, mode):
            raise RuntimeError(f"this job already trains with {self._mode}(); train_batch() and iterations() "
                               "cannot be mixed")
        self._mode = mode


class ResilientTrainer(_Modes):
    """The user's handle under ``resihp launch``: ``train_batch()`` per iteration, or the
    user's own loop body with ``iterations()`` (data-parallel jobs)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def train_batch(self) -> float | None:
        """Train one iteration; this rank's share of the global loss (its replica's
        micro-batches, on the last stage; 0 elsewhere), or None once the job has ended."""
        self._use("train_batch")
        r = self.worker.step()
        return None if r is None else float(r.loss)

    def iterations(self) -> Iterator[Iteration]:
        """The user's loop (pp = 1; docs/torch_native.md, "Your loop"): one
        :class:`~.loop.Iteration` per attempt until the job ends::

            for it in trainer.iterations():
                with it:
                    for batch in it.microbatches():
                        it.backward(it.model(**batch).loss)
                    it.step()
        """
        from resihp_core.runtime import session
        from resihp_adapters.torch_native.loop import iterations, refuse_pipelined

        adapter = self.worker.adapter
        engine = adapter.engine
        if engine.cfg is not None:
            raise TypeError("trainer.iterations() runs your own model: initialize(model, optimizer=..., dataset=...)")
        if self._mode is None:  # the first plan decides, before any generation is entered
            while (g := session.wait_generation(self.worker.store, -1, 2.0)) < 0:
                pass
            msg = session.read_plan(self.worker.store, g)
            if not msg.stop:
                plan = msg.parsed_plan()  # a refusal is the job's own error (docs/errors.md)
                refuse_pipelined(plan.pp, max(len(x) for rep in plan.tp_groups for x in rep))
        self._use("iterations")
        engine.whole = True
        return iterations(self.worker, engine, engine.data, adapter.result_of)

    @property
    def iteration(self) -> int:
        """Iterations committed so far."""
        return self.worker.iteration

    def is_last_stage(self) -> bool:
        e = self.worker.adapter.engine
        return e.place is not None and e.place.stage == e.plan.pp - 1

    def full_state(self) -> dict[str, Any]:
        """This rank's stage's complete state by layout-independent names (collective
        over the stage's data-parallel ranks; empty on a standby)."""
        return self.worker.adapter.engine.flat_state()


class StockTrainer(_Modes):
    """Plain torch (no ResiHP runtime): the same interface, the same data. The stock
    pipeline (``train_batch()``) or the stock FSDP2 loop (``iterations()``) is built on
    first use."""

    def __init__(self, make_pipeline: Callable[[], Any], iterations: int,
                 make_loop: Callable[[], Any] | None = None) -> None:
        self._make_pipeline, self._make_loop = make_pipeline, make_loop
        self.pipeline: Any = None
        self.loop: Any = None
        self.iterations_total = iterations

    def train_batch(self) -> float | None:
        self._use("train_batch")
        if self.pipeline is None:
            self.pipeline = self._make_pipeline()
        if self.pipeline.iteration >= self.iterations_total:
            return None
        return self.pipeline.step()

    def iterations(self) -> Iterator[Iteration]:
        """The user's loop on stock FSDP2 (see :meth:`ResilientTrainer.iterations`)."""
        if self._make_loop is None:
            raise TypeError("trainer.iterations() runs your own model: initialize(model, optimizer=..., dataset=...)")
        self._use("iterations")
        if self.loop is None:
            self.loop = self._make_loop()
        return self.loop.run()

    @property
    def iteration(self) -> int:
        if self.loop is not None:
            return self.loop.index
        return 0 if self.pipeline is None else self.pipeline.iteration

    def is_last_stage(self) -> bool:
        return self.loop is not None or (self.pipeline is not None and self.pipeline.is_last_stage)

    def full_state(self) -> dict[str, Any]:
        if self.loop is not None:
            return self.loop.flat_state()
        return {} if self.pipeline is None else self.pipeline.flat_state()


@dataclass
class UserJob:
    """What ``initialize(model, ...)`` hands the adapter: the model as stages, the
    recipe, and the data for a global batch of ``G`` micro-batches (``data(G)``)."""

    stages: UserStages
    recipe: Recipe
    data: Callable[[int], UserData]  # global micro-batches G -> the data


def _optimizer_factory(optimizer: Any) -> Callable[[list], Any]:
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != 1:
            raise ValueError("initialize(optimizer=...): an optimizer instance with several parameter groups "
                             "cannot be rebuilt per stage; pass a factory: optimizer=lambda params: ...")
        import inspect

        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        # defaults can hold entries the constructor does not take (AdamW: decoupled_weight_decay)
        defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
        return lambda params: cls(params, **defaults)
    if callable(optimizer):
        return optimizer
    raise TypeError("initialize(optimizer=...): a torch.optim.Optimizer or a factory of a parameter list")


def _scheduler_factory(lr_scheduler: Any) -> Callable[[Any], Any] | None:
    import torch

    if lr_scheduler is None:
        return None
    if isinstance(lr_scheduler, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        raise TypeError("initialize(lr_scheduler=...): pass a factory of the optimizer "
                        "(lr_scheduler=lambda opt: LambdaLR(opt, warmup)), not an instance: the optimizer is "
                        "rebuilt for every stage layout and the scheduler with it, at the committed iteration")
    if not callable(lr_scheduler):
        raise TypeError("initialize(lr_scheduler=...): a factory of the optimizer")
    return lr_scheduler


def _refuse_dropout(model: Any) -> None:
    """Active dropout draws from an RNG stream that depends on which rank runs which
    micro-batch: no layout change could reproduce it. Refused up front."""
    import torch

    bad = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    cfg = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(cfg, key, None), (int, float)) and getattr(cfg, key) > 0:
            bad.append(f"config.{key}")
    if bad:
        raise ValueError(f"initialize(model): active dropout ({', '.join(bad[:4])}) draws random numbers whose "
                         "stream depends on the layout, so training could not continue exactly across a "
                         "reconfiguration; set it to 0")


def user_job(model: Any, *, optimizer: Any, lr_scheduler: Any = None, loss_fn: Any = None,
             max_grad_norm: float | None = None, dataset: Any = None, collate_fn: Any = None,
             micro_batch_size: int = 1, split: Any = None, tp_plan: Any = None) -> UserJob:
    """Validate the user's pieces (errors name the argument) and bundle them.
    ``tp_plan``: module path (wildcards) -> "colwise" / "rowwise" / a torch
    ``ParallelStyle``, for plans with TP (default: the model's own, :mod:`.tp`)."""
    import torch

    from resihp_adapters.torch_native.data import UserData, hf_batch, hf_label_count, hf_loss_sum
    from resihp_adapters.torch_native.engine import Recipe
    from resihp_adapters.torch_native.split import UserStages

    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise TypeError("initialize(model): an nn.Module or a factory that builds one")
        model = model()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"initialize(model): the factory returned {type(model).__name__}, not an nn.Module")
    if optimizer is None:
        raise TypeError("initialize(model, optimizer=...): the optimizer (or a factory of a parameter list) is "
                        "needed; it is rebuilt over each stage's parameters")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"initialize(max_grad_norm=...): a number > 0, got {max_grad_norm!r}")
    if dataset is None:
        raise TypeError("initialize(model, dataset=...): a map-style dataset (with collate_fn) is needed, so that "
                        "any rank can read any micro-batch of any iteration")
    model.train()
    _refuse_dropout(model)
    stages = UserStages(model, split)
    if tp_plan is not None:
        from resihp_adapters.torch_native.tp import tp_styles

        tp_styles(tp_plan)  # refuses unknown styles up front, naming the path
    stages.tp_plan = tp_plan
    recipe = Recipe(optimizer=_optimizer_factory(optimizer), loss=loss_fn or hf_loss_sum,
                    lr_scheduler=_scheduler_factory(lr_scheduler),
                    max_grad_norm=None if max_grad_norm is None else float(max_grad_norm))
    prepare = hf_batch(stages.dtype) if split is None else _split_prepare(stages)
    count = hf_label_count if loss_fn is None else None

    def data(global_microbatches: int) -> UserData:
        return UserData(dataset, collate_fn, micro_batch_size=micro_batch_size,
                        global_microbatches=global_microbatches, prepare=prepare, count=count)

    return UserJob(stages, recipe, data)


def _split_prepare(stages: Any) -> Callable[[Any], Any]:
    """A custom split's batches: ``prepare`` of the split when it has one, else a
    collated ``(input, target)`` pair or a dict with ``input_ids`` / ``labels``."""
    from resihp_adapters.torch_native.data import UserBatch, hf_batch

    own = getattr(stages.split, "prepare", None)
    if callable(own):
        return own
    hf = hf_batch(stages.dtype)

    def prepare(batch: Any) -> Any:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return UserBatch((batch[0],), {}, batch[1])
        return hf(batch)

    return prepare


def initialize(model: Any = None, *, optimizer: Any = None, lr_scheduler: Any = None, loss_fn: Any = None,
               max_grad_norm: float | None = None, dataset: Any = None, collate_fn: Any = None,
               micro_batch_size: int = 1, split: Any = None, tp_plan: Any = None,
               config: str | os.PathLike | None = None) -> ResilientTrainer | StockTrainer:
    """See the module docstring. ``model``: the user's ``nn.Module`` (its current
    weights are the initial state) or a factory building it; a path instead names the
    ResiHP configuration and trains the adapter's own LLaMA. ``optimizer``: a factory of
    a parameter list (``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``) or an optimizer
    (rebuilt from its class and defaults). ``lr_scheduler``: a factory of the optimizer.
    ``loss_fn(output, target)``: a mean per micro-batch (default: Hugging Face's shifted
    token cross-entropy, normalised by the global batch's labelled tokens).
    ``max_grad_norm``: clip the global gradient norm. ``dataset`` / ``collate_fn`` /
    ``micro_batch_size``: the data (:class:`~.data.UserData`). ``split``: a
    :class:`~.split.Split` for models that are not Hugging Face decoders. ``tp_plan``: the
    tensor-parallel plan by module path for ``[parallel] tp`` > 1 (default: the model's
    own, a Hugging Face ``config.base_model_tp_plan``; :mod:`.tp`). ``config``: the
    ResiHP configuration file for a plain launch (default ``$RESIHP_CONFIG``)."""
    if isinstance(model, (str, os.PathLike)):
        if config is not None:
            raise TypeError("initialize(): a configuration path given twice (positional and config=)")
        config, model = model, None
    user = None if model is None else user_job(
        model, optimizer=optimizer, lr_scheduler=lr_scheduler, loss_fn=loss_fn, max_grad_norm=max_grad_norm,
        dataset=dataset, collate_fn=collate_fn, micro_batch_size=micro_batch_size, split=split, tp_plan=tp_plan)
    if os.environ.get("RESIHP_STORE"):
        import atexit
        import gc

        from resihp_core.runtime.worker import Worker
        from resihp_adapters.torch_native.adapter import TorchNativeAdapter

        os.environ["RESIHP_INITIALIZED"] = "1"
        worker = Worker.from_env(factory=lambda ctx: TorchNativeAdapter(ctx, user=user))
        if worker.job.adapter != "torch_native":
            raise RuntimeError(f"this script trains with torch_native, the job runs {worker.job.adapter!r}")
        # What is loaded so far lives for the whole process: keep it out of the
        # collections that run when a generation's groups are released.
        gc.freeze()
        atexit.register(_close_at_exit, worker)
        return ResilientTrainer(worker)
    return _stock(config or os.environ.get("RESIHP_CONFIG"), user)


def _close_at_exit(worker: Any) -> None:
    """Under ``resihp launch``: release the adapter's groups at exit if the script's loop
    ended before the job's stop reached the worker (which closes it then; a second
    close does nothing), as the DeepSpeed adapter's ``engine.close()`` at exit does. A
    gloo group left to interpreter shutdown can abort the process ("Exit" in
    docs/torch_native.md)."""
    try:
        worker.adapter.close()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _stock(config: str | os.PathLike | None, user: UserJob | None) -> StockTrainer:
    import atexit
    import datetime

    import torch
    import torch.distributed as dist

    from resihp_core.data import create_source

    from resihp_adapters.torch_native.adapter import parse_config
    from resihp_adapters.torch_native.data import Batches
    from resihp_adapters.torch_native.launch import settings
    from resihp_adapters.torch_native.plugin import job_section
    from resihp_adapters.torch_native.reference import StockPipeline
    from resihp_adapters.torchkit.device import CPU, release_world

    if not config:
        raise RuntimeError("initialize(): name the ResiHP configuration file (initialize(..., config='resihp.toml') "
                           "or RESIHP_CONFIG=...): it holds the pipeline depth, micro-batches and iterations")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        # Destroyed at exit while the interpreter is whole: a gloo thread left to
        # interpreter shutdown aborted the finished process (docs/torch_native.md, "Exit").
        atexit.register(release_world, CPU)
    cfg = settings(config, processes=dist.get_world_size())
    tr = cfg.training
    # The job resihp launch would run: the adapter's section and the [data] source.
    c = parse_config(job_section(cfg), tr.seed)
    if user is not None:
        model, recipe = user.stages, user.recipe
        data = user.data(cfg.parallel.dp * tr.microbatches)
        if model.n_layers != cfg.model.layers:
            raise ValueError(f"model.layers = {cfg.model.layers} in {config}, the model has {model.n_layers} blocks")
    else:
        model, recipe = c["model"], None
        source = create_source(cfg.data.section(), dp=cfg.parallel.dp, num_microbatches=tr.microbatches,
                               seed=tr.seed, token_budget=tr.token_budget, vocab_size=cfg.model.vocab)
        data = Batches(source, c["model"].torch_dtype)
    def pipeline() -> StockPipeline:
        return StockPipeline(model, data, pp=cfg.parallel.pp, num_microbatches=tr.microbatches,
                             shard=c["shard"], lr=c["lr"], weight_decay=c["weight_decay"],
                             schedule=cfg.scheduler.schedule, recipe=recipe, tp=cfg.parallel.tp,
                             tp_plan=None if user is None else user.stages.tp_plan)

    def loop() -> Any:
        from resihp_adapters.torch_native.loop import StockLoop, refuse_pipelined

        refuse_pipelined(cfg.parallel.pp, cfg.parallel.tp)
        return StockLoop(model, recipe, data, num_microbatches=tr.microbatches, shard=c["shard"],
                         iterations=tr.iterations)

    return StockTrainer(pipeline, tr.iterations, loop if user is not None else None)
