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

__all__ = ["PipelineSpec", "load_ds_config", "spec_from_adapter_config", "optimizer_factory", "torch_optimizer_config",
           "check_supported"]


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
    #: DeepSpeed's ``seed_layers``: ``initialize`` passes DeepSpeed's default (False)
    #: unless the user sets it; the adapter's own jobs (the kit) seed per layer.
    seed_layers: bool = True
    lr_scheduler: Any = None
    activation_checkpoint_interval: int = 0
    checkpointable_layers: list[str] | None = None
    shuffle: bool = False
    data_seed: int = 0
    partition_method: str = "uniform"
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
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise ValueError("lr_scheduler must be a factory 'optimizer -> scheduler' (DeepSpeed accepts one too): "
                             "ResiHP builds the engine again for every plan generation and carries the scheduler's "
                             "state over; a built scheduler is tied to one optimizer")
        from resihp_adapters.deepspeed.partition import check_partition_method

        self.partition_method = check_partition_method(self.partition_method)
        if hasattr(self.lr_scheduler, "state_dict") and hasattr(self.lr_scheduler, "step"):
            raise ValueError("lr_scheduler is a built scheduler; give a factory 'optimizer -> scheduler' instead "
                             "(ResiHP builds the engine again for every plan generation)")

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


#: DeepSpeed JSON optimizers that DeepSpeed builds as ``FusedAdam`` (a JIT-compiled op).
_FUSED_ADAM = ("adam", "adamw")


def torch_optimizer_config(config: Mapping[str, Any], *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The config with ``optimizer.params.torch_adam = true`` where the JSON names
    ``Adam``/``AdamW`` and no GPU is present: DeepSpeed would JIT-build ``FusedAdam``
    for the CPU (minutes: ``docs/deepspeed.md``); with ``torch_adam`` DeepSpeed itself
    builds ``torch.optim.Adam``/``AdamW`` (``AdamW`` unless ``adam_w_mode`` is false, as
    ``FusedAdam``'s default) with the same settings."""
    import torch

    cfg = dict(config)
    opt = cfg.get("optimizer")
    if not isinstance(opt, Mapping) or str(opt.get("type", "")).lower() not in _FUSED_ADAM:
        return cfg
    params = dict(opt.get("params") or {})
    if "torch_adam" in params or torch.cuda.is_available():
        return cfg
    params["torch_adam"] = True
    cfg["optimizer"] = {**opt, "params": params}
    if log is not None:
        log(f"DeepSpeed config optimizer {opt.get('type')!r}: no GPU, so DeepSpeed would JIT-build FusedAdam for "
            "the CPU (minutes); using DeepSpeed's own torch fallback (optimizer.params.torch_adam=true) instead")
    return cfg


def check_supported(config: Mapping[str, Any]) -> None:
    """Refuse, with the reason, what the adapter cannot carry across a reconfiguration."""
    zero = int((config.get("zero_optimization") or {}).get("stage", 0))
    if zero >= 2:
        raise ValueError(f"zero_optimization.stage={zero}: DeepSpeed pipelines support ZeRO stages 0 and 1 only "
                         "(DeepSpeed itself refuses 2 and 3 with pipeline parallelism)")
    if (config.get("fp16") or {}).get("enabled"):
        raise ValueError("fp16.enabled: ResiHP's DeepSpeed adapter does not carry fp16's dynamic loss scaler across "
                         "a reconfiguration yet; use bf16 (carried: master weights and their optimizer state) or fp32")
