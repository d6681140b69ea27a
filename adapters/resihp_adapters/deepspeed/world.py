"""One torch.distributed world per plan generation, rebuilt inside the surviving processes.

DeepSpeed cannot re-point a module or engine at new process groups (its grid reads the
default group; groups live in the module, the grid, the p2p module, ``groups.mpu`` and
the optimizer), so a new plan generation means: drop every reference to the old engine,
clear DeepSpeed's module-level group caches, destroy the default group, collect garbage
(gloo closes sockets only when the last reference to a group is gone), then join a new
world under the store prefix ``gen{g}/`` and build a new module and engine.

DeepSpeed's ``new_group`` passes no timeout, so its groups would get gloo's 30-minute
default. Two timeouts matter: joining a generation must outlast a survivor still
blocked in the previous one (DeepSpeed keeps references to its groups, so a peer's
sockets may stay open until that peer's operation times out), while an operation must
give up on a dead peer quickly. So groups are *created* with the long join timeout
(``default_pg_timeout`` patched before building) and, once the engine is built, every
group's operation timeout is lowered to ``timeout_s`` (:func:`bound_op_timeouts`).
See ``docs/deepspeed.md``.
"""

from __future__ import annotations

import gc
import importlib
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    import torch.distributed as dist

    from resihp_adapters.torchkit.device import Placement

from resihp_core.runtime.session import rendezvous_store

__all__ = ["prepare_deepspeed", "teardown_world", "init_world", "ds_config_for", "build_engine"]


def prepare_deepspeed(timeout_s: float, *, allow_float64: bool = True) -> None:
    """Process-wide settings before any DeepSpeed group exists: bounded group timeouts,
    no JIT build of the shared-memory all-reduce op (only used for inference), and
    (``allow_float64``) float64 gradients in DeepSpeed's DP reduction, which the CPU
    accelerator does not list; ResiHP's exactness tests train in float64."""
    import deepspeed.ops
    import torch
    import torch.distributed.distributed_c10d as c10d
    from deepspeed.accelerator import get_accelerator

    if allow_float64:
        acc = get_accelerator()
        base = acc.supported_dtypes
        if torch.float64 not in base():
            acc.supported_dtypes = lambda: [*base(), torch.float64]  # type: ignore[method-assign]

    c10d.default_pg_timeout = timedelta(seconds=join_timeout(timeout_s))
    from resihp_adapters.deepspeed.engine import bound_collectives

    bound_collectives()  # DeepSpeed's blocking collectives give up once superseded
    deepspeed.ops.__compatible_ops__ = {}
    # ``deepspeed.comm.torch`` as an attribute is the torch package; go through importlib.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    os.environ.setdefault("LOCAL_RANK", "0")  # PipelineModule reads it


def join_timeout(timeout_s: float) -> float:
    """How long joining a generation (rendezvous, group creation) may wait: longer than a
    survivor's operation timeout, so one still blocked in the old generation makes it."""
    return 6.0 * float(timeout_s) + 10.0


def bound_op_timeouts(timeout_s: float, superseded: Callable[[], bool] | None = None) -> None:
    """Lower the operation timeout of every process group of this world to ``timeout_s``;
    point-to-point waits also give up once ``superseded()`` (the generation was replaced)."""
    import torch.distributed.distributed_c10d as c10d

    from resihp_adapters.deepspeed import engine

    engine.P2P_TIMEOUT_S = float(timeout_s)
    engine.SUPERSEDED = superseded
    td = timedelta(seconds=float(timeout_s))
    for pg in list(c10d._world.pg_map.keys()):
        try:
            c10d._set_pg_timeout(td, pg)
        except (ValueError, RuntimeError, AssertionError):
            pass  # a group this rank is not part of


def dismantle(engine: Any) -> None:
    """Break an engine apart so its process groups can be freed now.

    DeepSpeed registers autograd hooks on parameters whose closures hold the engine; a
    reference cycle through C++ hooks is invisible to Python's garbage collector, so a
    dropped engine (and every group its grid and module hold) would live on and keep its
    sockets open: peers blocked on this rank would wait for their timeout. Emptying the
    engine's and module's attribute dictionaries leaves the hooks holding an empty shell."""
    if engine is None:
        return
    for obj in (getattr(engine, "module", None), getattr(engine, "optimizer", None),
                getattr(engine, "basic_optimizer", None), engine):
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            d.clear()


def teardown_world(placement: Placement | None = None) -> None:
    """Forget every group DeepSpeed and torch hold and end the default group (NCCL
    communicators are aborted, docs/gpu.md). The caller must already have dropped its
    own references to the engine and module."""
    import torch.distributed as tdist
    from deepspeed.runtime.pipe import p2p

    from resihp_adapters.torchkit.device import abort_if_nccl
    from deepspeed.utils import groups

    p2p._grid = None
    p2p._groups = None
    groups.mpu = None
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        getattr(groups, name).clear()
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "mesh_device"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    # DeepSpeed tracks the autograd graphs its engine's backward runs in a module-level
    # object; a backward interrupted by a failure can leave a registration behind that the
    # next engine's gradient hooks would read. Start every generation with a fresh one.
    ds_engine = importlib.import_module("deepspeed.runtime.engine")
    if hasattr(ds_engine, "_EngineBackwardGraphTracker"):
        ds_engine._ENGINE_BACKWARD_GRAPH_TRACKER = ds_engine._EngineBackwardGraphTracker()
        ds_engine._ENGINE_BACKWARD_GRAPH_CONTEXT.set(())
    if placement is not None:
        abort_if_nccl(placement)
    from resihp_adapters.deepspeed.engine import reap_retired, retire_groups

    reap_retired()
    if tdist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        retire_groups(list(c10d._world.pg_map))  # not destroyed under a still-running wait
        try:
            tdist.destroy_process_group()
        except Exception:  # a group with a dead peer may fail to shut down; drop it anyway
            pass
    gc.collect()


def init_world(store: dist.Store, generation: int, rank: int, world_size: int, timeout_s: float,
               placement: Placement | None = None) -> None:
    """Join plan generation ``generation``'s world in its rendezvous (gloo, or
    NCCL for CUDA tensors when ``placement`` says so, docs/gpu.md), waiting up to
    :func:`join_timeout`; call :func:`bound_op_timeouts` once built."""
    import deepspeed.comm as ds_dist
    import torch.distributed as tdist

    backend = placement.init_backend if placement is not None else "gloo"
    prefixed = rendezvous_store(store, generation)
    tdist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=timedelta(seconds=join_timeout(timeout_s))
    )
    ds_dist.init_distributed(dist_backend=placement.backend if placement is not None else "gloo",
                             dist_init_required=False, verbose=False)


def ds_config_for(config: Mapping[str, Any], *, micro_batch_size: int, num_microbatches: int,
                  replicas: int) -> dict[str, Any]:
    """The user's DeepSpeed config with the batch fields this plan generation implies:
    ``gradient_accumulation_steps`` is the *nominal* micro-batch count per replica (the
    loss scale), ``train_batch_size`` follows from the plan's replica count."""
    cfg = dict(config)
    zero = dict(cfg.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0))
    if stage >= 2:
        raise ValueError(f"zero_optimization.stage={stage}: DeepSpeed pipelines support ZeRO 0 and 1 only")
    cfg["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    cfg["gradient_accumulation_steps"] = int(num_microbatches)
    cfg["train_batch_size"] = int(micro_batch_size) * int(num_microbatches) * int(replicas)
    cfg.setdefault("steps_per_print", 10**9)
    return cfg


def build_engine(
    layers: list[Any],
    *,
    parts: list[int],
    topology: Any,
    config: Mapping[str, Any],
    optimizer: Any = None,
    loss_fn: Callable[..., Any] | None = None,
    seed_layers: bool = True,
    base_seed: int = 1234,
    lr_scheduler: Any = None,
    activation_checkpoint_interval: int = 0,
    checkpointable_layers: list[str] | None = None,
    count_build: bool = False,
):
    """A :class:`ResiPipelineModule` over ``parts`` and a :class:`ResiPipelineEngine`,
    built directly (``deepspeed.initialize`` hard-codes the stock engine class).
    ``count_build``: see :class:`ResiPipelineModule`."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from resihp_adapters.deepspeed.engine import ResiPipelineEngine, ResiPipelineModule

    module = ResiPipelineModule(
        layers, parts=parts, topology=topology, loss_fn=loss_fn, seed_layers=seed_layers, base_seed=base_seed,
        count_build=count_build,
        activation_checkpoint_interval=activation_checkpoint_interval, checkpointable_layers=checkpointable_layers,
    )
    mpu = module.mpu()
    engine = ResiPipelineEngine(
        args=None,
        model=module,
        optimizer=optimizer,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=False,
        config=dict(config),
        config_class=DeepSpeedConfig(dict(config), mpu),
    )
    return engine
