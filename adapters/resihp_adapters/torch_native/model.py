"""A small torchtitan-style LLaMA, split into pipeline stages at explicit layer boundaries.

Why it looks like this:

* **Stable names in every split.** A stage holds ``layers`` as an ``nn.ModuleDict`` keyed
  by the *global* layer index, plus ``tok_embeddings`` (first stage) and ``norm`` /
  ``output`` (last stage). A parameter is called the same (``layers.5.attention.wq.weight``)
  whichever stage holds it, so state moves between layouts by name and
  ``torch.distributed.checkpoint`` re-shards a checkpoint onto any split.
* **Split-independent initialisation.** Every parameter is drawn from a generator seeded
  by ``(seed, name)``: the weights are identical whatever the stage boundaries or data
  parallel degree, so runs under different plans can be compared to 1e-10 (float64).
* **Documents kept apart.** A micro-batch is one packed sequence of the job's data
  (:mod:`.data`): every stage's forward takes ``pos`` (RoPE positions restarting in each
  document) and ``mask`` (block-diagonal causal attention) as keyword arguments, which
  torch's pipeline runtime hands to all stages; only activations travel between them.
  Without them a stage treats the sequence as one causal document.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LlamaConfig", "LlamaStages", "StageModel", "TransformerBlock", "build_stage", "init_parameters", "loss_sum",
           "parameter_names"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class LlamaConfig:
    """Model sizes. ``dtype`` is 'float32' or 'float64'; ``seed`` fixes every weight."""

    vocab_size: int = 128
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 64
    dtype: str = "float64"
    seed: int = 0
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"LlamaConfig.{name} must be an int >= 1, got {v!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"LlamaConfig: dim={self.dim} must split into n_heads={self.n_heads} heads of even size"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"LlamaConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: Tensor, theta: float, pos: Tensor) -> Tensor:
    """Rotary position embedding over ``[batch, heads, seq, head_dim]`` at positions
    ``pos`` (``[batch, seq]``)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d))
    ang = pos.to(x.dtype)[:, None, :, None] * inv  # [batch, 1, seq, d/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.theta = cfg.n_heads, cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, pos: Tensor, mask: Tensor | None) -> Tensor:
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        q, k = _rope(q, self.theta, pos), _rope(k, self.theta, pos)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # [batch, seq, seq] -> one mask for every head
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, pos: Tensor, mask: Tensor | None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class StageModel(nn.Module):
    """Layers ``[start, end)`` of the model; the first stage embeds token ids, the last
    returns logits. The whole model is ``StageModel(cfg, 0, cfg.n_layers)``."""

    def __init__(self, cfg: LlamaConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.n_layers:
            raise ValueError(f"stage layer range {start}-{end} is not inside 0-{cfg.n_layers}")
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.n_layers
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if self.is_first else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(start, end)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if self.is_last else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if self.is_last else None

    def forward(self, x: Tensor, pos: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        """``x``: token ids ``[batch, seq]`` (first stage) or activations; ``pos``
        ``[batch, seq]`` (default 0..seq-1), ``mask`` ``[batch, seq, seq]`` bool (default
        causal)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if pos is None:
            pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        for layer in self.layers.values():
            h = layer(h, pos, mask)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def _generator(seed: int, name: str) -> torch.Generator:
    key = hashlib.sha256(f"resihp-torch-native/{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))


def init_parameters(module: nn.Module, cfg: LlamaConfig) -> None:
    """Seeded, split-independent weights (norm weights start at one)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else cfg.init_std
                p.copy_(torch.randn(p.shape, generator=_generator(cfg.seed, name), dtype=torch.float64) * std)


def build_stage(cfg: LlamaConfig, start: int, end: int, init: bool = True) -> StageModel:
    """A stage with its seeded initial weights, in the config's dtype; ``init=False``:
    uninitialised memory (the stage holds no buffers), for a stage whose every
    parameter is copied in next: its two initialisation passes were most of the time
    a re-split took to build it."""
    if init:
        m = StageModel(cfg, start, end).to(cfg.torch_dtype)
        init_parameters(m, cfg)
        return m
    with torch.device("meta"):
        m = StageModel(cfg, start, end).to(cfg.torch_dtype)
    return m.to_empty(device="cpu")


def parameter_names(cfg: LlamaConfig, layers: Iterable[int], first: bool, last: bool) -> list[str]:
    """Names of the parameters a stage holding ``layers`` has (no module is built)."""
    block = [n for n, _ in TransformerBlock(LlamaConfig(vocab_size=1, dim=2, n_layers=1, n_heads=1, ffn_dim=1)).named_parameters()]
    out = ["tok_embeddings.weight"] if first else []
    out += [f"layers.{i}.{n}" for i in layers for n in block]
    if last:
        out += ["norm.weight", "output.weight"]
    return out


def loss_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Summed next-token cross-entropy of one micro-batch over its labelled tokens
    (targets of -100 have none); the caller scales it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum",
                           ignore_index=-100)


class LlamaStages:
    """The adapter's own LLaMA as the engine's model (the interface
    :class:`~.split.UserStages` also has): stages with seeded, split-independent weights."""

    aliases: dict[str, str] = {}

    def __init__(self, cfg: LlamaConfig) -> None:
        self.cfg = cfg
        self.n_layers = cfg.n_layers
        self.dtype = cfg.torch_dtype

    def build(self, start: int, end: int, *, init: bool = True) -> StageModel:
        return build_stage(self.cfg, start, end, init)

    def blocks(self, module: StageModel) -> list[nn.Module]:
        return list(module.layers.values())

    def names(self, start: int, end: int) -> list[str]:
        return parameter_names(self.cfg, range(start, end), start == 0, end == self.cfg.n_layers)
