"""Megatron-Core on a machine without CUDA: every CUDA assumption it makes, bypassed here
and nowhere else.

Megatron-Core 0.16 assumes a CUDA device in a handful of places even when the model is
built with ``use_cpu_initialization=True`` and the groups are gloo ones: buffers made
with ``device="cuda"`` or ``torch.cuda.current_device()`` (attention masks, the
pipeline schedules' token counter and shape exchange, the gradient buffers, the
gradient-clipping norms, the optimizer's loss-scale tensors), ``.cuda()`` on the tied
output weight (a no-op here: without CUDA it could only raise), and the CUDA RNG
tracker. :func:`enable` gives each of those Megatron modules a
view of ``torch`` in which CUDA placement means the CPU; torch itself and every other
module are left untouched, except ``Tensor.cuda()``, which returns the tensor itself (it could
only raise here), and ``Tensor.type()``, which names float32 CPU tensors as CUDA ones
only while Megatron's gradient clipping runs (it asserts ``torch.cuda.FloatTensor``) and
while the distributed optimizer sorts its parameters into main-parameter groups. It
is applied only when ``torch.cuda.is_available()`` is
false: on a GPU the adapter runs Megatron-Core unmodified.
"""

from __future__ import annotations

import importlib
import types
from typing import Callable

import torch

__all__ = ["enable", "enabled", "PATCHED_MODULES"]

# The Megatron-Core modules a GPT training job runs that place tensors on CUDA by name,
# synchronise it or use its streams (a grep of 0.16.1).
PATCHED_MODULES: tuple[str, ...] = (
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.parallel_state",
    "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.exchange_utils",
)

_enabled = False


def _cpu(device: object) -> object:
    """``device`` with CUDA placement read as the CPU."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # an index from torch.cuda.current_device()
    return device


def _placing(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def made(*args: object, **kwargs: object) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return fn(*args, **kwargs)

    made.__name__ = getattr(fn, "__name__", "factory")
    return made


class _Stream:
    """A CUDA stream stand-in: Megatron only enters and waits on it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _cuda_view() -> types.SimpleNamespace:
    """``torch.cuda`` as the patched modules see it: the current device is the CPU,
    synchronisation and streams do nothing, the tensor-type names are CPU ones."""
    real = torch.cuda
    ns = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    ns.current_device = lambda: "cpu"
    ns.synchronize = lambda *a, **k: None
    ns.Stream = _Stream
    ns.current_stream = lambda *a, **k: _Stream()
    ns.stream = lambda s=None: _Stream()
    ns.is_available = lambda: False
    ns.FloatTensor = torch.FloatTensor
    ns.HalfTensor = torch.HalfTensor
    ns.BFloat16Tensor = torch.BFloat16Tensor
    return ns


class _TorchView(types.ModuleType):
    """``torch`` as the patched modules see it: factories put CUDA tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cuda_view()
        for name in ("zeros", "ones", "empty", "tensor", "full", "arange", "randn", "rand", "zeros_like",
                     "empty_like", "ones_like"):
            setattr(self, name, _placing(getattr(torch, name)))

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def _tensor_cuda(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """``Tensor.cuda()`` without CUDA: the tensor stays where it is (Megatron moves the
    tied output weight with it before all-reducing it)."""
    return self




_real_type = torch.Tensor.type


def _cuda_type_name(self: torch.Tensor, *args: object, **kwargs: object) -> object:
    """``Tensor.type()`` naming a CPU float32 tensor ``torch.cuda.FloatTensor``, as
    Megatron's gradient clipping asserts of every gradient."""
    name = _real_type(self, *args, **kwargs)
    if not args and not kwargs and name == "torch.FloatTensor":
        return "torch.cuda.FloatTensor"
    return name


def _with_cuda_type_names(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` run with :func:`_cuda_type_name` in place, and only while it runs."""

    def call(*args: object, **kwargs: object) -> object:
        torch.Tensor.type = _cuda_type_name  # type: ignore[method-assign]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = _real_type  # type: ignore[method-assign]

    call.__name__ = getattr(fn, "__name__", "call")
    return call


def enabled() -> bool:
    return _enabled


def enable() -> bool:
    """Apply the bypasses once per process when torch has no CUDA; returns whether they
    are active. Also selects Megatron's RNG tracker that needs no CUDA generator (dropout
    must be 0: the adapter refuses it on CPU)."""
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    view = _TorchView()
    for name in PATCHED_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue  # a module this Megatron-Core release does not have
        if getattr(mod, "torch", None) is torch:
            mod.torch = view
    torch.Tensor.cuda = _tensor_cuda  # type: ignore[method-assign]
    from megatron.core.optimizer import clip_grads, optimizer

    for name in ("clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        wrapped = _with_cuda_type_names(getattr(clip_grads, name))
        for mod in (clip_grads, optimizer):
            if hasattr(mod, name):
                setattr(mod, name, wrapped)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    # The distributed optimizer sorts its parameters by ``Tensor.type()``: float32 ones
    # are main parameters only under their CUDA name.
    build = DistributedOptimizer._build_model_and_main_param_groups.__func__
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(_with_cuda_type_names(build))
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _enabled = True
    return True
