"""Build, rebuild and drive ResiHP's DeepSpeed engine across plan generations, in-process.

A :class:`PipelineRunner` holds what it takes to build the engine for *any* plan (the
user's layer specs, loss, optimizer factory, DeepSpeed config, dataset and collate
function) and one device id. :meth:`PipelineRunner.enter` moves it to a new plan
generation: the layers' state is taken out of the old engine, the old world is torn
down, a new world is joined under the generation's store prefix, a new module and engine
are built for the new topology, and state arrives by global layer index from whichever
survivor holds it (or from a checkpoint when none does). The process, and so its PID,
stays the same. A device the plan leaves out joins no world: it is a standby.

The runtime decides plans and commits; the runner only executes them.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from resihp_core.plan import ParallelPlan
from resihp_core.predictor.schedules import emit_programs

from resihp_adapters.deepspeed.data import MicroBatchSource
from resihp_adapters.deepspeed.engine import device_rank, plan_topology
from resihp_adapters.deepspeed.spec import optimizer_factory
from resihp_adapters.deepspeed.state import (
    LayersLost,
    apply_layers,
    check_zero_stage,
    exchange_layers,
    extract_layers,
    transfer_plan,
    unit_keys,
    unit_name,
)
from resihp_adapters.deepspeed.world import (
    bound_op_timeouts,
    build_engine,
    dismantle,
    ds_config_for,
    init_world,
    prepare_deepspeed,
    teardown_world,
)

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """One device's engine across plan generations (see the module docstring)."""

    def __init__(
        self,
        layers: Sequence[Any],
        *,
        device: int,
        store: dist.Store,
        config: dict[str, Any],
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        loss_fn: Callable[..., Any] | None = None,
        optimizer: Any = None,
        nominal_replicas: int,
        timeout_s: float = 10.0,
        base_seed: int = 1234,
        initial_stages: int | None = None,
    ) -> None:
        self.layers = list(layers)
        # The job's initial stage count, whose (uniform) stage 0 DeepSpeed's gradient
        # clipping counts in every later layout; None: the first plan this runner enters.
        self.initial_stages = initial_stages
        self.device = int(device)
        self.store = store
        self.config = dict(config)
        self.micro_batch_size = int(self.config.get("train_micro_batch_size_per_gpu", 1))
        self.zero_stage = int((self.config.get("zero_optimization") or {}).get("stage", 0))
        self.dataset = dataset
        self.collate_fn = collate_fn or MicroBatchSource.default_collate
        self.loss_fn = loss_fn
        self.optimizer = optimizer_factory(optimizer)
        self.nominal_replicas = int(nominal_replicas)
        self.timeout_s = float(timeout_s)
        self.base_seed = base_seed
        self.engine: Any = None
        self.plan: ParallelPlan | None = None
        self.source: MicroBatchSource | None = None
        self.iteration = 0
        self.commit_hook: Callable[[Any], bool] | None = None
        self.last_rebuild_s: dict[str, float] = {}
        prepare_deepspeed(self.timeout_s)

    # ---------------------------------------------------------------- state
    @property
    def active(self) -> bool:
        return self.engine is not None

    def layer_state(self) -> dict[int, dict[str, Any]]:
        """Copies of this rank's layers' parameters and optimizer state."""
        return extract_layers(self.engine) if self.engine is not None else {}

    # ---------------------------------------------------------------- generations
    def enter(self, plan: ParallelPlan, *, previous: ParallelPlan | None, iteration: int,
              lost: frozenset[int] = frozenset(), checkpoint_dir: str | None = None) -> bool:
        """Move to ``plan`` (whose generation keys the new world). ``previous`` is the plan
        the survivors last ran (None: fresh start); ``lost`` are devices of ``previous``
        whose state is gone (dead). Returns False when this device is a standby. With a
        layer nobody holds, every rank restores from ``checkpoint_dir`` instead (and
        :attr:`iteration` becomes the checkpoint's)."""
        t0 = time.perf_counter()
        mine = self.layer_state() if self.plan is not None and previous is not None and \
            self.plan.location(self.device) is not None else {}
        engine, self.engine = self.engine, None
        dismantle(engine)
        del engine
        teardown_world()
        t1 = time.perf_counter()
        self.plan, self.iteration = plan, int(iteration)
        if self.initial_stages is None:
            self.initial_stages = plan.pp  # a standby too: it may run a later, smaller layout
        if plan.location(self.device) is None:
            self.last_rebuild_s = {"teardown": t1 - t0}
            return False
        have = set()
        if previous is not None:
            have = (set(previous.devices()) & set(plan.devices())) - set(lost)
        try:
            transfers = transfer_plan(previous, plan, have, self._tied())
            restore = False
        except LayersLost:
            if checkpoint_dir is None:
                raise
            transfers, restore = [], True
        if previous is not None and (transfers or restore or plan.dp != previous.dp):
            check_zero_stage(self.zero_stage, moving_state=True)
        init_world(self.store, plan.generation, device_rank(plan, self.device), len(plan.devices()),
                   self.timeout_s)
        t2 = time.perf_counter()
        self.engine = self._build(plan)
        bound_op_timeouts(self.timeout_s)
        t3 = time.perf_counter()
        if restore:
            self.iteration = self._restore(checkpoint_dir)  # type: ignore[arg-type]
        else:
            received, _ = exchange_layers(self.device, plan, transfers, mine)
            keep = {i: st for i, st in mine.items() if i in unit_keys(self.engine)}
            if keep or received:
                apply_layers(self.engine, {**keep, **received})
        self.engine.iteration = self.iteration
        self.engine.global_steps = self.iteration
        self.engine.global_samples = self.iteration * self.engine.train_batch_size()
        t4 = time.perf_counter()
        self.last_rebuild_s = {"teardown": t1 - t0, "join": t2 - t1, "build": t3 - t2, "state": t4 - t3}
        return True

    def _tied(self) -> dict[str, set[int]]:
        """Tie key -> layer indices of the model (``TiedLayerSpec`` groups)."""
        from deepspeed.runtime.pipe.module import TiedLayerSpec

        out: dict[str, set[int]] = {}
        for i, spec in enumerate(self.layers):
            if isinstance(spec, TiedLayerSpec):
                out.setdefault(spec.key, set()).add(i)
        return out

    def _build(self, plan: ParallelPlan) -> Any:
        cfg = ds_config_for(self.config, micro_batch_size=self.micro_batch_size,
                            num_microbatches=plan.num_microbatches, replicas=plan.dp)
        from resihp_adapters.deepspeed.engine import is_partial

        if is_partial(plan):  # its loss scale and reductions are the adapter's (docs/deepspeed.md)
            raise ValueError("PipelineRunner runs whole replicas; a partial-replica plan runs through the adapter")
        parts = [a for a, _ in plan.layer_ranges] + [plan.num_layers]
        if plan.num_layers != len(self.layers):
            raise ValueError(f"plan has {plan.num_layers} layers, the model has {len(self.layers)}")
        engine = build_engine(self.layers, parts=parts, topology=plan_topology(plan), config=cfg,
                              optimizer=self.optimizer, loss_fn=self.loss_fn, base_seed=self.base_seed)
        self.source = MicroBatchSource(self.dataset, self.collate_fn, self.micro_batch_size,
                                       plan.num_microbatches, self.nominal_replicas)
        if plan.dp > self.nominal_replicas:
            raise ValueError(f"plan has {plan.dp} replicas, the job's data is split for {self.nominal_replicas}")
        replica, stage, _ = plan.location(self.device)  # type: ignore[misc]
        program = next(p for p in emit_programs(plan) if (p.replica, p.stage) == (replica, stage))
        engine.set_work(plan, program, self.source)
        engine.commit_hook = self.commit_hook
        from resihp_adapters.deepspeed.adapter import initial_stage0_layers

        engine.clip_norm_layers = initial_stage0_layers(self.layers, self.initial_stages or plan.pp)
        return engine

    # ---------------------------------------------------------------- iterations
    def train_iteration(self) -> float | None:
        """Run one iteration of this executor's program; the loss (mean over the plan's
        micro-batches) on last-stage ranks, None elsewhere. Raises on a dead peer."""
        if self.engine is None:
            raise RuntimeError(f"device {self.device} is a standby in plan generation {self.plan and self.plan.generation}")
        self.engine.commit_hook = self.commit_hook
        loss = self.engine.train_batch()
        self.iteration = self.engine.iteration
        return float(loss) if self.engine.is_last_stage() else None

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Per-layer files (DeepSpeed's layer naming, parameters and optimizer state),
        written by replica 0 of each stage; ``meta.json`` records the iteration."""
        import torch

        if self.engine is None or self.plan is None:
            return
        replica, stage, t = self.plan.location(self.device)  # type: ignore[misc]
        if replica != 0:
            return
        os.makedirs(path, exist_ok=True)
        for idx, st in extract_layers(self.engine).items():
            tmp = os.path.join(path, f".{unit_name(idx)}-tp{t}.pt.{os.getpid()}.tmp")
            torch.save(st, tmp)
            os.replace(tmp, os.path.join(path, f"{unit_name(idx)}-tp{t}.pt"))
        if stage == 0 and t == 0:
            tmp = os.path.join(path, ".meta.json.tmp")
            with open(tmp, "w") as f:
                json.dump({"iteration": self.iteration, "num_layers": len(self.layers)}, f)
            os.replace(tmp, os.path.join(path, "meta.json"))

    def _restore(self, path: str) -> int:
        import torch

        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        _, _, t = self.plan.location(self.device)  # type: ignore[union-attr,misc]
        layers = {}
        for idx in unit_keys(self.engine):
            f = os.path.join(path, f"{unit_name(idx)}-tp{t}.pt")
            if not os.path.exists(f):
                raise FileNotFoundError(f"checkpoint {path} has no state for {unit_name(idx)} (TP index {t})")
            layers[idx] = torch.load(f, weights_only=True)
        apply_layers(self.engine, layers)
        return int(meta["iteration"])

    def load_checkpoint(self, path: str) -> None:
        """Restore this rank's layers from ``path`` (layout-independent)."""
        self.iteration = self._restore(path)
        self.engine.iteration = self.engine.global_steps = self.iteration

    def close(self) -> None:
        engine, self.engine = self.engine, None
        dismantle(engine)
        del engine
        teardown_world()
