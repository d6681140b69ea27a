"""What a DeepSpeed pipeline job is made of, in a form that can be built again.

ResiHP rebuilds the module and engine for every plan generation, so it keeps the
*recipe* of the user's ``PipelineModule`` (its layer specs and loss) rather than one
built module, and an optimizer factory rather than one optimizer.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["PipelineSpec", "load_ds_config", "spec_from_adapter_config", "optimizer_factory"]


@dataclass
class PipelineSpec:
    """The user's job: ``layers`` (``LayerSpec``s or modules, as for ``PipelineModule``),
    ``loss_fn``, a map-style ``dataset`` with ``collate_fn`` (returns DeepSpeed's
    ``(inputs, labels)``), an ``optimizer`` (a torch optimizer, a factory
    ``params -> optimizer``, or None to build it from the DeepSpeed config) and the
    DeepSpeed ``config`` (a dict; its ``resihp`` section is ResiHP's)."""

    layers: list[Any]
    config: dict[str, Any]
    dataset: Any
    loss_fn: Callable[..., Any] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    optimizer: Any = None
    base_seed: int = 1234
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("PipelineSpec.layers is empty")
        if not isinstance(self.config, dict):
            raise ValueError(f"PipelineSpec.config must be a dict, got {type(self.config).__name__}")
        mbs = self.config.get("train_micro_batch_size_per_gpu")
        if not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"DeepSpeed config: train_micro_batch_size_per_gpu must be an integer >= 1, got {mbs!r}")
        if not hasattr(self.dataset, "__getitem__") or not hasattr(self.dataset, "__len__"):
            raise ValueError("PipelineSpec.dataset must be map-style (__getitem__ and __len__)")

    @property
    def micro_batch_size(self) -> int:
        return int(self.config["train_micro_batch_size_per_gpu"])

    @property
    def resihp(self) -> dict[str, Any]:
        """The ``resihp`` section of the DeepSpeed config (empty if absent)."""
        sec = self.config.get("resihp") or {}
        if not isinstance(sec, dict):
            raise ValueError("DeepSpeed config: the 'resihp' section must be an object")
        return sec


def load_ds_config(config: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """A DeepSpeed config as a dict: given, a JSON path, or (None) the file accelerate
    points workers at (``ACCELERATE_DEEPSPEED_CONFIG_FILE``)."""
    if config is None:
        config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if not config:
            raise ValueError("no DeepSpeed config given and ACCELERATE_DEEPSPEED_CONFIG_FILE is not set")
    if isinstance(config, Mapping):
        return dict(config)
    with open(config) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"DeepSpeed config {config}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {config}: must be a JSON object")
    return data


def spec_from_adapter_config(adapter_config: Mapping[str, Any], job: Any) -> PipelineSpec:
    """Build the spec a job's ``adapter_config`` names: ``{"model": "module:function",
    ...}``; the function gets the whole section and the job and returns a
    :class:`PipelineSpec`."""
    target = adapter_config.get("model")
    if not isinstance(target, str) or ":" not in target:
        raise ValueError("adapter_config.model must name the job's builder as 'module:function' "
                         f"(returning a PipelineSpec), got {target!r}")
    module, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    spec = fn(dict(adapter_config), job)
    if not isinstance(spec, PipelineSpec):
        raise TypeError(f"adapter_config.model {target} returned {type(spec).__name__}, not a PipelineSpec")
    return spec


def optimizer_factory(optimizer: Any) -> Any:
    """An optimizer instance becomes a factory of its class and settings (an engine is
    built per generation, each time with new parameters); a callable or None passes."""
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        cls, defaults = type(optimizer), dict(optimizer.defaults)
        return lambda params: cls(params, **defaults)
    return optimizer
