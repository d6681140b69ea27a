"""A user's model split into pipeline stages by its own module paths.

The split protocol (docs/torch_native.md, "Your model"): a decoder-style model is
``pre`` modules (embeddings, first stage), an ordered list of ``blocks`` (one "layer"
each; a stage holds a contiguous range) and ``post`` modules (final norm and head, last
stage); ``shared`` modules without parameters (a rotary embedding) are held by every
stage. Four functions say what flows between them:

* ``embed(stage, inputs, kwargs) -> hidden`` on the first stage;
* ``context(stage, hidden, kwargs) -> dict``: keyword arguments every block of the stage
  takes, computed once per stage and micro-batch (HF: rotary cos/sin, the mask);
* ``block(module, hidden, context) -> hidden``;
* ``head(stage, hidden) -> output`` on the last stage;
* optionally ``prepare(batch) -> UserBatch``: a collated batch as the pipeline's inputs,
  keyword arguments for every stage and loss target.

Only ``hidden`` travels between stages; ``kwargs`` (positions, masks) are handed to every
stage by torch's pipeline runtime. A stage (:class:`Stage`) keeps each held submodule at
its path in the user's model, so its parameters have the user's fully qualified names
whatever the split: state moves, re-shards and checkpoints by those names.

Tied parameters (one ``Parameter`` under several names, e.g. HF's tied ``lm_head.weight``
and ``model.embed_tokens.weight``) stay one parameter inside a stage that holds all its
names. Split over stages, each holding stage keeps a copy under its own name; the
engine sums their gradients across those stages before the step and counts them once
in the gradient norm, so the copies stay equal (:func:`tied_names`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

__all__ = ["Split", "Stage", "UserStages", "hf_decoder_split", "split_for", "check_split", "stage_param_names", "tied_names",
           "additive_mask"]

Kwargs = Mapping[str, Tensor]


@dataclass(frozen=True)
class Split:
    """How a model splits into pipeline stages (see the module docstring)."""

    pre: tuple[str, ...]
    blocks: tuple[str, ...]
    post: tuple[str, ...]
    embed: Callable[["Stage", Tensor, Kwargs], Tensor]
    block: Callable[[nn.Module, Tensor, dict], Tensor]
    head: Callable[["Stage", Tensor], Tensor]
    context: Callable[["Stage", Tensor, Kwargs], dict] = field(default=lambda stage, h, kw: dict(kw))
    shared: tuple[str, ...] = ()
    #: collated batch -> :class:`~.data.UserBatch` (inputs, every stage's kwargs, target);
    #: None: an ``(input, target)`` pair, or a Hugging Face style dict
    prepare: Callable[[object], object] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    def paths(self, start: int, end: int) -> list[str]:
        """Module paths a stage holding blocks ``[start, end)`` keeps."""
        out = list(self.shared)
        if start == 0:
            out += self.pre
        out += self.blocks[start:end]
        if end == self.n_layers:
            out += self.post
        return out


def _get(root: nn.Module, path: str) -> nn.Module:
    mod = root
    for part in path.split("."):
        mod = getattr(mod, part)  # ModuleList / ModuleDict children are attributes too
    return mod


class Stage(nn.Module):
    """Blocks ``[start, end)`` of ``source`` (plus pre / post / shared modules), each at its
    own path so parameters keep the user's names. The held modules are copies: the
    user's model is left as it was."""

    def __init__(self, split: Split, source: nn.Module, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= split.n_layers:
            raise ValueError(f"stage block range {start}-{end} is not inside 0-{split.n_layers}")
        self.split, self.start, self.end = split, start, end
        self.is_first, self.is_last = start == 0, end == split.n_layers
        memo: dict[int, object] = {}  # one deepcopy memo: parameters tied inside the stage stay tied
        for path in split.paths(start, end):
            parent: nn.Module = self
            *heads, leaf = path.split(".")
            for part in heads:
                if not hasattr(parent, part) or getattr(parent, part) is None:
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, copy.deepcopy(_get(source, path), memo))

    def part(self, path: str) -> nn.Module:
        """The held module at ``path`` (a path of the user's model)."""
        return _get(self, path)

    def block_modules(self) -> list[nn.Module]:
        return [self.part(p) for p in self.split.blocks[self.start:self.end]]

    def forward(self, x: Tensor, **kwargs: Tensor) -> Tensor:
        sp = self.split
        h = sp.embed(self, x, kwargs) if self.is_first else x
        ctx = sp.context(self, h, kwargs)
        for block in self.block_modules():
            h = sp.block(block, h, ctx)
        return sp.head(self, h) if self.is_last else h


def tied_names(model: nn.Module) -> dict[str, str]:
    """Every alias name of a parameter shared under several names -> its first name (the
    one ``named_parameters()`` reports: the state's name)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B, T, T]`` bool (True: may attend) -> ``[B, 1, T, T]`` additive mask (0 or the
    dtype's minimum), what HF attention implementations (eager and sdpa) add to scores."""
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed[:, None], zero, torch.finfo(dtype).min)


# ------------------------------------------------------------------ Hugging Face
def _hf_embed(stage: Stage, ids: Tensor, kw: Kwargs) -> Tensor:
    return stage.part("model.embed_tokens")(ids)


def _hf_context(stage: Stage, h: Tensor, kw: Kwargs) -> dict:
    pos = kw.get("position_ids")
    if pos is None:
        pos = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
    ctx = {"position_ids": pos, "attention_mask": kw.get("attention_mask"),
           "position_embeddings": stage.part("model.rotary_emb")(h, pos)}
    return ctx


def _hf_block(layer: nn.Module, h: Tensor, ctx: dict) -> Tensor:
    out = layer(h, **ctx)
    return out[0] if isinstance(out, tuple) else out


def _hf_head(stage: Stage, h: Tensor) -> Tensor:
    return stage.part("lm_head")(stage.part("model.norm")(h))


def hf_decoder_split(model: nn.Module) -> Split:
    """The split of a Hugging Face decoder-only causal LM of the LLaMA family (LLaMA,
    Qwen2, Mistral, ...: ``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head``), torchtitan-style by hand (the pipelining
    tracer fails on these models)."""
    base = getattr(model, "model", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, a) for a in need) or not hasattr(model, "lm_head"):
        raise TypeError(f"{type(model).__name__} is not a decoder-only causal LM of the LLaMA family "
                        "(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head); "
                        "describe its split with resihp_adapters.torch_native.Split")
    n = len(base.layers)
    return Split(pre=("model.embed_tokens",), blocks=tuple(f"model.layers.{i}" for i in range(n)),
                 post=("model.norm", "lm_head"), shared=("model.rotary_emb",), embed=_hf_embed,
                 block=_hf_block, head=_hf_head, context=_hf_context)


def split_for(model: nn.Module, split: Split | None = None) -> Split:
    """``split`` if given, else the model's own (``model.resihp_split()``), else the
    Hugging Face decoder split."""
    if split is not None:
        return split
    own = getattr(model, "resihp_split", None)
    if callable(own):
        return own()
    return hf_decoder_split(model)


def check_split(split: Split, model: nn.Module) -> None:
    """Every path exists and every parameter of the model belongs to exactly one held
    module (a parameter nowhere would silently not train)."""
    held: set[int] = set()
    for path in (*split.pre, *split.blocks, *split.post, *split.shared):
        try:
            _get(model, path)
        except (AttributeError, IndexError, TypeError):
            raise ValueError(f"split: {type(model).__name__} has no module at {path!r}") from None
    for path in split.shared:
        if any(True for _ in _get(model, path).parameters()):
            raise ValueError(f"split: shared module {path!r} has parameters; every stage would train its own copy")
    for path in (*split.pre, *split.blocks, *split.post):
        held.update(id(p) for p in _get(model, path).parameters())
    missing = [n for n, p in model.named_parameters() if id(p) not in held]
    if missing:
        raise ValueError(f"split: parameters {missing[:5]} are in no pre / block / post module")


def stage_param_names(split: Split, model: nn.Module, start: int, end: int) -> list[str]:
    """Names a stage's parameters have (its own ``named_parameters``), without building it."""
    out: list[str] = []
    seen: set[int] = set()
    for path in split.paths(start, end):
        for n, p in _get(model, path).named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(f"{path}.{n}")
    return out


class UserStages:
    """A user's model as the engine's model: stages cut from it by ``split``, holding
    copies of its modules (its current weights are the initial state)."""

    def __init__(self, model: nn.Module, split: Split | None = None, *, seed: int = 0) -> None:
        from resihp_adapters.torch_native.materialize import check_initialisable, on_meta

        self.source = model
        self.split = split_for(model, split)
        check_split(self.split, model)
        #: on the meta device: each stage materialises only what it holds, every split path
        #: under its own seed (docs/torch_native.md, "Models on the meta device")
        self.meta = on_meta(model)
        self.seed = seed
        if self.meta:
            check_initialisable(model, self._all_paths())
        self.aliases = tied_names(model)
        self.n_layers = self.split.n_layers
        floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
        self.dtype = floats[0] if floats else torch.float32
        self._names: dict[tuple[int, int], list[str]] = {}
        #: the user's TP plan (None: the model's own; docs/torch_native.md, "Tensor parallelism")
        self.tp_plan: dict | None = None

    def _all_paths(self) -> list[str]:
        sp = self.split
        return [*sp.shared, *sp.pre, *sp.blocks, *sp.post]

    def build(self, start: int, end: int, *, init: bool = True) -> Stage:
        # ``init`` is not used: the user's modules may hold buffers their own
        # initialisation makes (rotary frequencies), so a stage is always built whole.
        stage = Stage(self.split, self.source, start, end)
        if self.meta:
            from resihp_adapters.torch_native.materialize import materialise

            materialise(stage, self.source, self.split.paths(start, end), self._all_paths(), self.aliases, self.seed)
        return stage

    def build_whole(self) -> nn.Module:
        """A copy of the whole user model, for the user's own loop (pp = 1,
        :mod:`.loop`): the user's ``forward`` and outputs, the same parameter names."""
        whole = copy.deepcopy(self.source)
        if self.meta:
            from resihp_adapters.torch_native.materialize import materialise

            paths = self._all_paths()
            covered = {n for x in paths for n, _ in _get(whole, x).named_parameters(prefix=x, remove_duplicate=False)}
            rest = [n for n, _ in whole.named_parameters(remove_duplicate=False) if n not in covered]
            if rest:
                raise ValueError(f"initialize(model): meta parameters {rest[:5]} are in no module of the split")
            materialise(whole, self.source, paths, paths, self.aliases, self.seed)
        return whole

    def blocks(self, module: nn.Module) -> list[nn.Module]:
        if isinstance(module, Stage):
            return module.block_modules()
        return [_get(module, p) for p in self.split.blocks]

    def names(self, start: int, end: int) -> list[str]:
        key = (start, end)
        if key not in self._names:
            self._names[key] = stage_param_names(self.split, self.source, start, end)
        return self._names[key]
