"""Reference LLaMA-style decoder with Megatron-style tensor parallelism, in pure torch.

Why it looks like this:

* **Packed variable-length micro-batches.** A micro-batch is one sequence of N tokens
  made of whole or split documents (``lengths`` sums to N). Attention is causal *within*
  each document and computed per document segment, so its cost really is
  proportional to Σ l_i² (docs/design.md §3.3) instead of N² for a dense mask. RoPE positions
  restart at 0 for each document.
* **Exact tensor parallelism.** Column/row-parallel linears and a vocab-parallel
  embedding, LM head and cross-entropy, joined by the usual conjugate autograd pair
  (``copy_to_tp``: identity forward, all-reduce backward; ``reduce_from_tp``: the
  reverse). ``tp_group=None`` means TP 1 and no communication.
* **TP-independent initialisation.** Every parameter's *full* tensor is drawn from a
  generator seeded by ``(config.seed, parameter name)`` and each rank keeps its shard,
  so the unsharded weights are identical for every TP degree and every stage split;
  runs under different plans can be compared to 1e-10 in float64.
* **Pipeline stages by layer range.** :func:`build_stage` builds the layers of one
  stage; ``stage.layers`` is an ``nn.ModuleDict`` keyed by the *global* layer index, so
  parameter names (``layers.7.wq.weight``) are the same in every split, and layers can
  be moved between stages (:meth:`StageModule.remove_layer` / ``add_layer``).
  :func:`shard_state` / :func:`unshard_state` re-shard full state for another TP degree.

Shapes carry no batch dimension: token ids are ``[N]``, hidden states ``[N, hidden]``.
The last stage returns the **sum** of the per-token cross-entropy over labelled tokens;
the caller divides by the number of labelled tokens of the whole global batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ATTENTION_QUERY_BLOCK",
    "IGNORE_INDEX",
    "ColumnParallelLinear",
    "DecoderLayer",
    "ModelConfig",
    "RMSNorm",
    "RowParallelLinear",
    "StageModule",
    "TPContext",
    "VocabParallelEmbedding",
    "build_layer",
    "build_model",
    "build_stage",
    "copy_to_tp",
    "document_attention",
    "gather_full_state",
    "init_parameter",
    "make_labels",
    "reduce_from_tp",
    "shard_dim",
    "shard_state",
    "unshard_state",
    "vocab_parallel_cross_entropy",
]

#: Label value of tokens that have no next-token target (ends of documents).
IGNORE_INDEX = -100

_DTYPES = {"float32": torch.float32, "float64": torch.float64}

#: Dimension along which each parameter is sharded across TP ranks (None: replicated).
#: Keyed by the last two components of the parameter name.
_SHARD_DIMS: dict[str, int | None] = {
    "embed.weight": 0,  # vocab-parallel rows
    "attn_norm.weight": None,
    "wq.weight": 0,  # column parallel: output features (whole heads)
    "wk.weight": 0,
    "wv.weight": 0,
    "wo.weight": 1,  # row parallel: input features
    "mlp_norm.weight": None,
    "w_gate.weight": 0,
    "w_up.weight": 0,
    "w_down.weight": 1,
    "final_norm.weight": None,
    "lm_head.weight": 0,  # vocab-parallel rows
}


@dataclass(frozen=True)
class ModelConfig:
    """Model sizes. ``dtype`` is 'float32' or 'float64'; ``seed`` fixes all weights."""

    vocab_size: int = 256
    hidden: int = 64
    num_heads: int = 4
    ffn_hidden: int = 176
    num_layers: int = 4
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.02
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "num_heads", "ffn_hidden", "num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be an int >= 1, got {v!r}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"ModelConfig: hidden={self.hidden} is not divisible by num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even (RoPE)")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.init_std > 0:
            raise ValueError(f"ModelConfig.init_std must be > 0, got {self.init_std!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError unless heads, FFN width and vocabulary split evenly."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        for name in ("num_heads", "ffn_hidden", "vocab_size"):
            if getattr(self, name) % tp_size:
                raise ValueError(
                    f"TP degree {tp_size} does not divide {name}={getattr(self, name)}"
                )


# --------------------------------------------------------------------- TP plumbing
class TPContext:
    """The TP group shared by every module of a stage, so it can be swapped in one place
    when communicators are rebuilt (same degree; a new degree needs re-sharding)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, wire: torch.device | None = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid TP rank {rank} of size {size}")
        if size > 1 and group is None:
            raise ValueError(f"TP size {size} needs a process group (None means TP 1)")
        if group is not None and dist.get_world_size(group) != size:
            raise ValueError(
                f"TP group has {dist.get_world_size(group)} ranks, expected tp_size={size}"
            )
        self.group = group
        self.rank = rank
        self.size = size
        # Where tensors must be to travel (docs/gpu.md): the host when GPU tensors go over
        # gloo, which has no CUDA collectives for every op; None = where they are.
        self.wire = wire

    @property
    def active(self) -> bool:
        return self.group is not None and self.size > 1


def tp_all_reduce(x: Tensor, ctx: TPContext, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """In-place all-reduce of ``x`` inside the TP group, through ``ctx.wire``."""
    if ctx.wire is None or x.device == ctx.wire:
        dist.all_reduce(x, op=op, group=ctx.group)
        return
    staged = x.to(ctx.wire)
    dist.all_reduce(staged, op=op, group=ctx.group)
    x.copy_(staged)


def _all_reduce(x: Tensor, ctx: TPContext) -> Tensor:
    x = x.clone()
    tp_all_reduce(x, ctx)
    return x


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, tp: TPContext) -> Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, tp: TPContext) -> Tensor:  # type: ignore[override]
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_tp(x: Tensor, tp: TPContext) -> Tensor:
    """Enter the TP region: replicated input, partial gradients summed in backward."""
    return _CopyToTP.apply(x, tp) if tp.active else x


def reduce_from_tp(x: Tensor, tp: TPContext) -> Tensor:
    """Leave the TP region: sum partial results across ranks."""
    return _ReduceFromTP.apply(x, tp) if tp.active else x


# --------------------------------------------------------------------- layers
def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ColumnParallelLinear(nn.Module):
    """y_local = x W_localᵀ with W split by output rows. ``copy_input`` applies f; turn it
    off when several column-parallel layers share one input that already went through f."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPContext, dtype: torch.dtype,
        *, copy_input: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.copy_input = copy_input
        self.weight = _param((out_features // tp.size, in_features), dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.tp)
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_local W_localᵀ with W split by input columns; the input is already
    split (the output of a column-parallel layer)."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _param((out_features, in_features // tp.size), dtype)

    def forward(self, x: Tensor) -> Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split across TP ranks; out-of-range ids look
    up zeros locally and the all-reduce fills them in."""

    def __init__(self, vocab: int, hidden: int, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.per_rank = vocab // tp.size
        self.weight = _param((self.per_rank, hidden), dtype)

    def forward(self, ids: Tensor) -> Tensor:
        if not self.tp.active:
            return F.embedding(ids, self.weight)
        start = self.tp.rank * self.per_rank
        outside = (ids < start) | (ids >= start + self.per_rank)
        local = torch.where(outside, torch.zeros_like(ids), ids - start)
        out = F.embedding(local, self.weight) * (~outside).unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_tp(out, self.tp)


#: Queries per attention block. Blocking bounds the score matrix of a long document to
#: heads x 512 x l, which stays cache-resident on CPUs, so the cost per score element
#: does not grow with l and the attention cost stays proportional to l².
ATTENTION_QUERY_BLOCK = 512


def document_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int]) -> Tensor:
    """Causal attention within each document of a packed sequence.

    ``q, k, v``: ``[N, heads, head_dim]``; ``lengths`` sums to N. Each document segment is
    attended on its own with plain batched matmuls (scores + causal bias, softmax,
    weighted sum), one block of :data:`ATTENTION_QUERY_BLOCK` queries at a time against
    all the document's keys (no block skipping), so the work is exactly proportional to
    Σ l_i², not N², and the fixed cost per document stays small. (On CPU, PyTorch's
    fused SDPA kernels are not quadratic in l at these sizes and cost more per call.)

    ``split`` (not indexing) cuts segments and blocks: the backward of one split is a
    single concatenation, while each indexed slice would materialise a full-size zero
    gradient, an O(#documents · N) overhead that swamps short documents.
    """
    scale = q.shape[-1] ** -0.5
    lengths = [int(n) for n in lengths]
    qs, ks, vs = (t.transpose(0, 1).split(lengths, dim=1) for t in (q, k, v))
    outs = []
    for qd, kd, vd in zip(qs, ks, vs):
        n = qd.shape[1]
        kt = kd.transpose(1, 2)
        start = 0
        for qb in qd.split(ATTENTION_QUERY_BLOCK, dim=1):
            rows = qb.shape[1]
            bias = torch.full((rows, n), float("-inf"), dtype=qd.dtype, device=qd.device).triu_(start + 1)
            scores = torch.baddbmm(bias, qb, kt, alpha=scale)
            outs.append(torch.bmm(scores.softmax(-1), vd))
            start += rows
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    return out.transpose(0, 1)


def _rope_tables(
    lengths: Sequence[int], head_dim: int, theta: float, dtype: torch.dtype,
    device: torch.device | None = None,
) -> tuple[Tensor, Tensor]:
    pos = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths])
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = pos[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)[:, None, :]  # [N, 1, head_dim]
    return ang.cos().to(device=device, dtype=dtype), ang.sin().to(device=device, dtype=dtype)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    """Pre-norm LLaMA block: RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual."""

    def __init__(self, config: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        h, dt = config.hidden, config.torch_dtype
        self.tp = tp
        self.heads = config.num_heads // tp.size
        self.head_dim = config.head_dim
        self.attn_norm = RMSNorm(h, config.norm_eps, dt)
        self.wq = ColumnParallelLinear(h, h, tp, dt, copy_input=False)
        self.wk = ColumnParallelLinear(h, h, tp, dt, copy_input=False)
        self.wv = ColumnParallelLinear(h, h, tp, dt, copy_input=False)
        self.wo = RowParallelLinear(h, h, tp, dt)
        self.mlp_norm = RMSNorm(h, config.norm_eps, dt)
        self.w_gate = ColumnParallelLinear(h, config.ffn_hidden, tp, dt, copy_input=False)
        self.w_up = ColumnParallelLinear(h, config.ffn_hidden, tp, dt, copy_input=False)
        self.w_down = RowParallelLinear(config.ffn_hidden, h, tp, dt)

    def forward(self, x: Tensor, lengths: Sequence[int], cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        a = copy_to_tp(self.attn_norm(x), self.tp)
        q = _apply_rope(self.wq(a).view(n, self.heads, self.head_dim), cos, sin)
        k = _apply_rope(self.wk(a).view(n, self.heads, self.head_dim), cos, sin)
        v = self.wv(a).view(n, self.heads, self.head_dim)
        x = x + self.wo(document_attention(q, k, v, lengths).reshape(n, -1))
        m = copy_to_tp(self.mlp_norm(x), self.tp)
        return x + self.w_down(F.silu(self.w_gate(m)) * self.w_up(m))


def vocab_parallel_cross_entropy(
    logits: Tensor, labels: Tensor, tp: TPContext
) -> Tensor:
    """Summed next-token cross-entropy over labelled tokens, with the vocabulary split
    across TP ranks (``logits`` is this rank's ``[N, vocab / tp]`` slice). Every rank
    returns the same loss; gradients reach each rank's slice exactly."""
    per_rank = logits.shape[-1]
    start = tp.rank * per_rank
    valid = labels != IGNORE_INDEX
    # The max only stabilises exp(); the loss does not depend on it, so no gradient.
    m = logits.detach().max(dim=-1).values
    if tp.active:
        tp_all_reduce(m, tp, dist.ReduceOp.MAX)
    z = logits - m.unsqueeze(-1)
    sumexp = reduce_from_tp(z.exp().sum(-1), tp)
    local = labels - start
    mine = valid & (local >= 0) & (local < per_rank)
    picked = z.gather(1, local.clamp(0, per_rank - 1).unsqueeze(1)).squeeze(1)
    target = reduce_from_tp(torch.where(mine, picked, torch.zeros_like(picked)), tp)
    per_token = sumexp.log() - target
    return torch.where(valid, per_token, torch.zeros_like(per_token)).sum()


def make_labels(tokens: Tensor, lengths: Sequence[int]) -> Tensor:
    """Next-token labels inside each document; the last token of each document gets
    :data:`IGNORE_INDEX` (no target across a document boundary)."""
    _check_lengths(lengths, tokens.shape[0])
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:-1] = tokens[1:]
    ends = torch.cumsum(torch.tensor(list(lengths)), 0) - 1
    labels[ends] = IGNORE_INDEX
    return labels


def _check_lengths(lengths: Sequence[int], n: int) -> None:
    if not lengths or any(int(l) < 1 for l in lengths):
        raise ValueError(f"document lengths must be a non-empty list of ints >= 1, got {lengths!r}")
    if sum(lengths) != n:
        raise ValueError(f"document lengths sum to {sum(lengths)} but the micro-batch has {n} tokens")


# --------------------------------------------------------------------- stages
class StageModule(nn.Module):
    """One pipeline stage: optional embedding, a run of decoder layers, optional head.

    ``forward(x, lengths, labels=None)``: ``x`` is token ids ``[N]`` on the first stage,
    hidden states ``[N, hidden]`` otherwise. Returns hidden states, or on the last stage
    the summed loss (with ``labels``) or this rank's vocab-parallel logits (without).
    """

    def __init__(
        self, config: ModelConfig, layer_indices: Sequence[int], is_first: bool, is_last: bool,
        tp: TPContext,
    ) -> None:
        super().__init__()
        self.config = config
        self.is_first = is_first
        self.is_last = is_last
        self.tp = tp
        dt = config.torch_dtype
        if is_first:
            self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden, tp, dt)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, tp) for i in layer_indices})
        if is_last:
            self.final_norm = RMSNorm(config.hidden, config.norm_eps, dt)
            self.lm_head = ColumnParallelLinear(config.hidden, config.vocab_size, tp, dt)

    def layer_indices(self) -> list[int]:
        """Global indices of the layers held, in execution order."""
        return sorted(int(k) for k in self.layers.keys())

    def set_tp_group(self, group: dist.ProcessGroup | None) -> None:
        """Swap in a rebuilt TP communicator of the same degree and rank."""
        new = TPContext(group, self.tp.rank, self.tp.size)
        self.tp.group = new.group

    def remove_layer(self, index: int) -> dict[str, Tensor]:
        """Drop layer ``index`` and return its local (sharded) state, detached."""
        layer = self.layers.pop(str(index))
        return {k: v.detach().clone() for k, v in layer.state_dict().items()}

    def add_layer(self, index: int, local_state: Mapping[str, Tensor]) -> DecoderLayer:
        """Insert layer ``index`` from a local (this rank's shard) state dict."""
        if str(index) in self.layers:
            raise ValueError(f"stage already holds layer {index}")
        layer = DecoderLayer(self.config, self.tp)
        layer.load_state_dict(dict(local_state))
        self.layers[str(index)] = layer
        return layer

    def forward(self, x: Tensor, lengths: Sequence[int], labels: Tensor | None = None) -> Tensor:
        lengths = [int(l) for l in lengths]
        _check_lengths(lengths, x.shape[0])
        h = self.embed(x) if self.is_first else x
        cos, sin = _rope_tables(lengths, self.config.head_dim, self.config.rope_theta, h.dtype, h.device)
        for i in self.layer_indices():
            h = self.layers[str(i)](h, lengths, cos, sin)
        if not self.is_last:
            return h
        logits = self.lm_head(self.final_norm(h))
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.tp)


# --------------------------------------------------------------------- init and sharding
def shard_dim(name: str) -> int | None:
    """TP shard dimension of parameter ``name`` (any prefix), None if replicated."""
    key = ".".join(name.split(".")[-2:])
    if key not in _SHARD_DIMS:
        raise KeyError(f"unknown parameter {name!r}")
    return _SHARD_DIMS[key]


def _full_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    h, f, v = config.hidden, config.ffn_hidden, config.vocab_size
    return {
        "embed.weight": (v, h),
        "attn_norm.weight": (h,),
        "wq.weight": (h, h),
        "wk.weight": (h, h),
        "wv.weight": (h, h),
        "wo.weight": (h, h),
        "mlp_norm.weight": (h,),
        "w_gate.weight": (f, h),
        "w_up.weight": (f, h),
        "w_down.weight": (h, f),
        "final_norm.weight": (h,),
        "lm_head.weight": (v, h),
    }[".".join(name.split(".")[-2:])]


def init_parameter(config: ModelConfig, name: str) -> Tensor:
    """The full (unsharded) initial value of parameter ``name`` (global name such as
    ``layers.3.wq.weight``), from a generator seeded by ``(config.seed, name)``.

    Norm weights start at 1; output projections (``wo``, ``w_down``) use the
    depth-scaled std/√(2·layers) of GPT-2/Megatron.
    """
    shape = _full_shape(config, name)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=config.torch_dtype)
    digest = hashlib.sha256(f"resihp-model/{config.seed}/{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    std = config.init_std
    if name.endswith(("wo.weight", "w_down.weight")):
        std = std / (2.0 * config.num_layers) ** 0.5
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(config.torch_dtype)


def shard_state(full: Mapping[str, Tensor], tp_rank: int, tp_size: int) -> dict[str, Tensor]:
    """This rank's shards of a full state dict (layer-relative or global names)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"invalid TP rank {tp_rank} of size {tp_size}")
    out = {}
    for name, t in full.items():
        d = shard_dim(name)
        if d is not None and t.shape[d] % tp_size:
            raise ValueError(f"{name}: dim {d} of size {t.shape[d]} does not split {tp_size} ways")
        out[name] = t.detach().clone() if d is None else t.detach().chunk(tp_size, d)[tp_rank].clone()
    return out


def unshard_state(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Rebuild full tensors from every TP rank's shards (in TP-rank order)."""
    if not shards:
        raise ValueError("unshard_state needs at least one shard")
    out = {}
    for name in shards[0]:
        d = shard_dim(name)
        parts = [s[name].detach() for s in shards]
        out[name] = parts[0].clone() if d is None else torch.cat(parts, d)
    return out


def gather_full_state(local: Mapping[str, Tensor], tp: TPContext) -> dict[str, Tensor]:
    """Collective: every TP rank gets the full tensors of ``local`` (for re-sharding)."""
    if not tp.active:
        return {k: v.detach().clone() for k, v in local.items()}
    out = {}
    for name, t in local.items():
        d = shard_dim(name)
        if d is None:
            out[name] = t.detach().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(tp.size)]
        dist.all_gather(parts, t.detach().contiguous(), group=tp.group)
        out[name] = torch.cat(parts, d)
    return out


def _load_init(module: nn.Module, config: ModelConfig, prefix: str, tp: TPContext) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters(prefix=prefix):
            full = init_parameter(config, name)
            d = shard_dim(name)
            p.copy_(full if d is None else full.chunk(tp.size, d)[tp.rank])


def build_layer(
    config: ModelConfig, index: int, tp: TPContext
) -> DecoderLayer:
    """Decoder layer ``index`` with this rank's shard of its seeded initial weights."""
    layer = DecoderLayer(config, tp)
    _load_init(layer, config, f"layers.{index}", tp)
    return layer


def build_stage(
    config: ModelConfig,
    layer_range: tuple[int, int],
    is_first: bool,
    is_last: bool,
    tp_group: dist.ProcessGroup | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> StageModule:
    """The stage holding layers ``[start, end)`` with seeded, TP-independent weights."""
    a, b = layer_range
    if not 0 <= a <= b <= config.num_layers:
        raise ValueError(f"layer range {a}-{b} is outside 0-{config.num_layers}")
    if a == b and not (is_first or is_last):
        raise ValueError(f"layer range {a}-{b} is empty")
    config.check_tp(tp_size)
    tp = TPContext(tp_group, tp_rank, tp_size)
    stage = StageModule(config, range(a, b), is_first, is_last, tp)
    _load_init(stage, config, "", tp)
    return stage


def build_model(
    config: ModelConfig,
    tp_group: dist.ProcessGroup | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> StageModule:
    """The whole model as a single stage."""
    return build_stage(config, (0, config.num_layers), True, True, tp_group, tp_rank, tp_size)
