"""A model on the meta device, materialised one stage at a time (docs/torch_native.md,
"Models on the meta device").

``initialize(model)`` with a model built under ``torch.device("meta")`` allocates no
weights up front; each stage materialises only the modules it holds. For the result to
be independent of the split (a stage of any layout, a re-split after a failure, the
single-process reference and the stock path all see the same initial weights), every
module path of the split (pre, blocks, post, shared) is initialised on its own under a
seed derived from the job's seed and the path: materialising a stage equals
materialising the whole model and then cutting the stage out of it, to the bit.

The initialisation is the model's own: a Hugging Face model's ``_init_weights`` (what its
``post_init`` runs, rotary buffers included) applied to every sub-module of the path, or
else each sub-module's ``reset_parameters()``. A module that holds tensors and has
neither is refused up front with its path (its weights would be ``torch.empty``
garbage). A parameter tied under several paths (tied embeddings) takes the value its
first name's module gives it (the state's name, :func:`.split.tied_names`), whichever
stage holds which alias.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Callable

import torch
from torch import nn

__all__ = ["on_meta", "init_of", "check_initialisable", "materialise"]

Init = Callable[[nn.Module], None]


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def path_seed(seed: int, path: str) -> int:
    """The seed a module path is initialised under: the job's seed and the path only."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def init_of(model: nn.Module) -> Init:
    """The model's own initialisation of one module (not recursive): Hugging Face's
    ``_init_weights``, else the module's ``reset_parameters``."""
    hf = getattr(model, "_init_weights", None)
    if callable(hf) and hasattr(model, "config"):
        return hf

    def reset(module: nn.Module) -> None:
        fn = getattr(module, "reset_parameters", None)
        if callable(fn):
            fn()

    return reset


def check_initialisable(model: nn.Module, paths: list[str]) -> None:
    """Refuse a meta model some of whose tensors no initialisation would write."""
    if callable(getattr(model, "_init_weights", None)) and hasattr(model, "config"):
        return  # Hugging Face: _init_weights covers its modules (and says what it skips)
    from resihp_adapters.torch_native.split import _get

    for path in paths:
        for name, sub in _get(model, path).named_modules(prefix=path):
            if _holds_tensors(sub) and not callable(getattr(sub, "reset_parameters", None)):
                raise ValueError(
                    f"initialize(model): the model is on the meta device and module {name!r} "
                    f"({type(sub).__name__}) holds parameters or buffers but has no reset_parameters(): "
                    "ResiHP cannot materialise it; give it reset_parameters(), or pass a model "
                    "with its weights (docs/torch_native.md)")


def _init_path(module: nn.Module, init: Init, seed: int) -> None:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for sub in module.modules():
            init(sub)


def materialise(root: nn.Module, source: nn.Module, paths: list[str], split_paths: list[str],
                aliases: dict[str, str], seed: int, device: torch.device | str = "cpu") -> None:
    """Allocate and initialise ``root``'s modules at ``paths`` (copies of ``source``'s
    meta modules, each at its own path) in place: each path under its own seed, tied
    aliases set to their first name's value. ``split_paths``: every path of the split."""
    from resihp_adapters.torch_native.split import _get

    init = init_of(source)
    ties: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    root.to_empty(device=device)  # a new Parameter per module: ties inside root are cut ...
    for names in ties.values():  # ... and put back
        keep = root.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(root.get_submodule(owner) if owner else root, leaf, keep)
    for path in paths:
        _init_path(_get(root, path), init, path_seed(seed, path))
    # A tied parameter: the value its first name's module gives it. The alias's module
    # (initialised after it, or held without it) overwrote it: put it back from a scratch
    # copy of the first name's module, initialised exactly as its own path is.
    held = dict(root.named_parameters(remove_duplicate=False))
    done: set[int] = set()
    for alias, first in aliases.items():
        for name in (alias, first):
            p = held.get(name)
            if p is None or id(p) in done:
                continue
            done.add(id(p))
            path = _owner_path(split_paths, first)
            scratch = copy.deepcopy(_get(source, path))
            scratch.to_empty(device=device)
            _init_path(scratch, init, path_seed(seed, path))
            value = dict(scratch.named_parameters(prefix=path, remove_duplicate=False))[first]
            with torch.no_grad():
                p.copy_(value)


def _owner_path(paths: list[str], name: str) -> str:
    """The split path parameter ``name`` lives under."""
    hits = [x for x in paths if name.startswith(x + ".")]
    if not hits:
        raise ValueError(f"parameter {name!r} is in no module path of the split")
    return max(hits, key=len)
