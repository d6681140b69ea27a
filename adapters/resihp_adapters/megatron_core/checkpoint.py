"""The adapter's checkpoints: Megatron-Core ``dist_checkpointing`` checkpoints, one per
iteration folder of the project's checkpoint contract (:mod:`resihp_core.checkpoints`).

A folder ``<checkpoint_dir>/iter<NNNNNNNN>/`` holds one ``dist_checkpointing``
checkpoint (``metadata.json``, ``common.pt``, torch DCP's ``.metadata`` and ``*.distcp``)
plus the contract's ``manifest.json``, written last by one rank once every writer
succeeded. Its content:

- ``model``: each stage model's own ``sharded_state_dict()`` (global layer offsets, TP
  axes, the tied output layer a replica of the word embedding), the keys Megatron-LM
  writes, so ``dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)``
  loads it at any TP x PP;
- ``optimizer.state.exp_avg.<key>`` / ``optimizer.state.exp_avg_sq.<key>``: Adam's
  moments shaped and sharded like parameter ``<key>`` (the naming of Megatron's
  ``make_sharded_optimizer_tensor``). With the distributed optimizer these are the whole
  moments the adapter gathers after each step, so no DP degree is baked in;
- common (``common.pt``): ``resihp`` (iteration, optimizer step, scheduler position in
  samples, data position) and ``opt_param_scheduler`` (the scheduler's ``state_dict()``).

Saving is synchronous and stays in the calling process: Megatron's default
``torch_dist`` save strategy hands the write to forked writer processes and a spawned
results queue (which re-imports the main script), so :class:`SyncTorchDistSave` writes
the same torch DCP files with torch's in-process ``FileSystemWriter``. Loading uses
Megatron's default strategy (torch DCP's reader, in process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch import Tensor

__all__ = ["MOMENTS", "SyncTorchDistSave", "sharded_state", "save", "load", "load_common"]

#: Adam's two moments, by their name in Megatron's optimizer state.
MOMENTS = ("exp_avg", "exp_avg_sq")


class SyncTorchDistSave(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` format written by torch DCP in the calling process (no
    forked writers, no spawned queue, no CUDA synchronisation)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, thread_count=1)

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
        """What the parent's ``async_save`` prepares (its key translation, Megatron's save
        planner), then torch DCP's synchronous save. The two translation helpers are
        private to Megatron-Core's ``strategies.torch`` (0.16.x, pinned in constraints.txt)."""
        import torch.distributed.checkpoint as dcp
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        dcp.save(mcore_to_pyt_state_dict(flat, False),
                 storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                 planner=MCoreSavePlanner(flatten_state_dict=False))


def sharded_state(model: torch.nn.Module, moments: Mapping[int, tuple[Tensor, Tensor]]
                  ) -> tuple[dict[str, Any], dict[str, tuple[Tensor, ...]]]:
    """The checkpoint's sharded part for this rank's stage ``model`` with Adam's
    ``moments`` by id of the parameter, and ``{model key: (parameter, exp_avg,
    exp_avg_sq)}`` (where a load's values go). A parameter without moments is an error:
    the checkpoint would lose its optimizer state."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model_sd = model.sharded_state_dict()
    optim: dict[str, dict[str, Any]] = {m: {} for m in MOMENTS}
    targets: dict[str, tuple[Tensor, ...]] = {}
    covered: set[int] = set()
    for key, sh in model_sd.items():
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or not isinstance(sh.data, torch.nn.Parameter):
            continue
        pair = moments.get(id(sh.data))
        if pair is None:
            raise KeyError(f"parameter {key!r} has no Adam moments to checkpoint")
        for name, t in zip(MOMENTS, pair):
            optim[name][key] = make_sharded_optimizer_tensor(sh, t, f"optimizer.state.{name}")
        targets[key] = (sh.data, *pair)
        covered.add(id(sh.data))
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise KeyError(f"parameters {missing} are not in the model's sharded_state_dict()")
    return {"model": model_sd, "optimizer": {"state": optim}}, targets


def save(folder: str | Path, model: torch.nn.Module, moments: Mapping[int, tuple[Tensor, Tensor]],
         common: dict[str, Any]) -> None:
    """Write this rank's part of one ``dist_checkpointing`` checkpoint into ``folder``
    (collective over the default process group: every rank of the world calls it)."""
    from megatron.core import dist_checkpointing

    state, _ = sharded_state(model, moments)
    state.update(common)
    dist_checkpointing.save(state, str(folder), sharded_strategy=SyncTorchDistSave())


def load(folder: str | Path, model: torch.nn.Module, moments: Mapping[int, tuple[Tensor, Tensor]]) -> None:
    """Fill ``model``'s parameters and ``moments`` in place from checkpoint ``folder``,
    whatever layout wrote it (collective over the default process group)."""
    from megatron.core import dist_checkpointing

    state, targets = sharded_state(model, moments)
    loaded = dist_checkpointing.load(state, str(folder))
    with torch.no_grad():
        for key, (param, *pair) in targets.items():
            param.copy_(loaded["model"][key])
            for name, t in zip(MOMENTS, pair):
                t.copy_(loaded["optimizer"]["state"][name][key])


def load_common(folder: str | Path) -> dict[str, Any]:
    """The checkpoint's common part (no process group needed: a standby reads it too)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    return TorchCommonLoadStrategy().load_common(Path(folder))
