"""Micro-batch compute cost model and link (communication) model.

Why: the fail-slow filter (docs/design.md §3.2) and the Scheduler's plan search (§3.4, §4) need
the *healthy* time of every pipeline chunk for the actual documents of an iteration.
For a packed micro-batch of N tokens made of documents of lengths l_i with per-document
causal attention (§3.3)::

    T = α·N + β·Σ l_i² + γ + δ·D

α·N covers projections, MLP, norms (linear in tokens); β·Σ l_i² covers attention,
which is quadratic in each document's length. Two optional terms help fidelity where
the backend has fixed overheads: γ per micro-batch (launch and framework overhead) and
δ per document D (backends that launch attention once per document, such as the CPU
reference backend, pay a fixed cost per call; a fused variable-length kernel has
δ ≈ 0). With packing every warm-up micro-batch has the same N, so γ cannot be told
apart from α·N; it is then folded into α (γ = 0) and predictions at that N are
unaffected. Forward and backward are fitted separately, per stage, by least squares
on warm-up measurements (:func:`fit_stage`).

Scaling to other plans (:meth:`StageCost.forward` etc.): time is linear in the number
of layers a stage holds, inversely proportional to the TP degree (compute splits
across TP ranks; TP communication is costed separately by :class:`LinkModel`), and
divided by the normalised throughput p in (0, 1] of the slowest device of the TP group.

Units: seconds, bytes, bytes/s. No torch; numpy is imported lazily inside
:func:`fit_stage` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from resihp_core.plan import ParallelPlan, ScheduleKind

if TYPE_CHECKING:
    from resihp_core.predictor.corpus import Workload

__all__ = [
    "CostModel",
    "CostModelError",
    "LinkModel",
    "Sample",
    "StageCost",
    "VertexKey",
    "activation_bytes",
    "fit_stage",
    "group_speed",
    "mape",
    "vertex_times",
]

#: One warm-up measurement: (document lengths, forward seconds, backward seconds).
Sample = tuple[Sequence[int], float, float]

#: (kind 'F'|'B'|'W', executing replica, stage, owner replica, micro-batch).
VertexKey = tuple[str, int, int, int, int]


class CostModelError(ValueError):
    """The cost model cannot be fitted or evaluated; the message says why."""


def _features(lengths: Sequence[int]) -> tuple[int, int, int]:
    """(N, Σ l², D) of a micro-batch."""
    if len(lengths) == 0:
        raise CostModelError("a micro-batch must hold at least one document")
    n = s = 0
    for l in lengths:
        if not isinstance(l, int) or isinstance(l, bool) or l < 1:
            raise CostModelError(f"document lengths must be ints >= 1, got {l!r}")
        n += l
        s += l * l
    return n, s, len(lengths)


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise CostModelError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class StageCost:
    """Fitted cost of one pipeline stage, measured at ``ref_layers`` layers and TP degree
    ``ref_tp`` on a healthy device (p = 1).

    ``w_fraction`` is the share of the backward that computes weight gradients; the
    zero-bubble schedules split the backward into B (input gradient) and W (weight
    gradient) and this is how the split is costed.
    """

    alpha_f: float
    beta_f: float
    alpha_b: float
    beta_b: float
    gamma_f: float = 0.0
    gamma_b: float = 0.0
    delta_f: float = 0.0
    delta_b: float = 0.0
    ref_layers: int = 1
    ref_tp: int = 1
    w_fraction: float = 0.5

    def __post_init__(self) -> None:
        for name in (
            "alpha_f", "beta_f", "gamma_f", "delta_f", "alpha_b", "beta_b", "gamma_b", "delta_b"
        ):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise CostModelError(f"{name} must be a finite number, got {v!r}")
        if not isinstance(self.ref_layers, int) or self.ref_layers < 1:
            raise CostModelError(f"ref_layers must be an int >= 1, got {self.ref_layers!r}")
        if not isinstance(self.ref_tp, int) or self.ref_tp < 1:
            raise CostModelError(f"ref_tp must be an int >= 1, got {self.ref_tp!r}")
        if not (0.0 <= self.w_fraction <= 1.0):
            raise CostModelError(f"w_fraction must be in [0, 1], got {self.w_fraction!r}")

    def _scale(self, layers: int | None, tp: int | None, speed: float) -> float:
        layers = self.ref_layers if layers is None else layers
        tp = self.ref_tp if tp is None else tp
        if not isinstance(layers, int) or layers < 0:
            raise CostModelError(f"layers must be an int >= 0, got {layers!r}")
        if not isinstance(tp, int) or tp < 1:
            raise CostModelError(f"tp must be an int >= 1, got {tp!r}")
        _positive("speed", speed)
        return (layers / self.ref_layers) * (self.ref_tp / tp) / speed

    def forward(
        self, lengths: Sequence[int], *, layers: int | None = None, tp: int | None = None,
        speed: float = 1.0,
    ) -> float:
        """Forward seconds of one micro-batch with these document lengths."""
        n, s, d = _features(lengths)
        t = self.alpha_f * n + self.beta_f * s + self.gamma_f + self.delta_f * d
        return t * self._scale(layers, tp, speed)

    def backward(
        self, lengths: Sequence[int], *, layers: int | None = None, tp: int | None = None,
        speed: float = 1.0,
    ) -> float:
        """Full backward (input + weight gradients) seconds."""
        n, s, d = _features(lengths)
        t = self.alpha_b * n + self.beta_b * s + self.gamma_b + self.delta_b * d
        return t * self._scale(layers, tp, speed)

    def backward_input(
        self, lengths: Sequence[int], *, layers: int | None = None, tp: int | None = None,
        speed: float = 1.0,
    ) -> float:
        """B of a split backward: ``(1 - w_fraction)`` of the full backward."""
        return (1.0 - self.w_fraction) * self.backward(lengths, layers=layers, tp=tp, speed=speed)

    def backward_weight(
        self, lengths: Sequence[int], *, layers: int | None = None, tp: int | None = None,
        speed: float = 1.0,
    ) -> float:
        """W of a split backward: ``w_fraction`` of the full backward."""
        return self.w_fraction * self.backward(lengths, layers=layers, tp=tp, speed=speed)


def fit_stage(
    samples: Sequence[Sample],
    *,
    ref_layers: int = 1,
    ref_tp: int = 1,
    intercept: bool | None = None,
    per_document: bool = False,
    w_fraction: float = 0.5,
    min_samples: int = 3,
) -> StageCost:
    """Least-squares fit of α, β (and γ, δ) for forward and backward from warm-up samples.

    ``intercept``: None fits γ only when N varies across samples (otherwise γ and α·N
    are the same column); True insists on γ; False never fits it. ``per_document``
    also fits δ, the cost per document. Raises :class:`CostModelError` when there are
    too few samples or the design cannot identify β (e.g. every micro-batch has the
    same Σ l², or all documents have the same length so Σ l² is proportional to N).
    """
    import numpy as np

    samples = list(samples)
    if min_samples < 1:
        raise CostModelError(f"min_samples must be >= 1, got {min_samples}")
    feats: list[tuple[int, int, int]] = []
    tf: list[float] = []
    tb: list[float] = []
    for i, sample in enumerate(samples):
        try:
            lengths, f, b = sample
        except (TypeError, ValueError):
            raise CostModelError(
                f"sample {i} must be (doc_lengths, forward_s, backward_s), got {sample!r}"
            ) from None
        for name, t in (("forward_s", f), ("backward_s", b)):
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                raise CostModelError(f"sample {i}: {name} must be a finite number >= 0, got {t!r}")
        feats.append(_features(lengths))
        tf.append(float(f))
        tb.append(float(b))
    ns = [f[0] for f in feats]
    ss = [f[1] for f in feats]
    ds = [f[2] for f in feats]
    if intercept is None:
        intercept = len(set(ns)) > 1
    k = 2 + int(intercept) + int(per_document)
    need = max(min_samples, k)
    if len(samples) < need:
        raise CostModelError(
            f"warm-up has {len(samples)} samples; fitting {k} coefficients needs at least {need}"
        )
    if len(set(ss)) == 1:
        raise CostModelError(
            f"every warm-up micro-batch has the same Σ l² = {ss[0]}, so β (attention cost) "
            "cannot be separated from α; warm up on micro-batches with varied document lengths"
        )
    cols = [np.asarray(ns, dtype=float), np.asarray(ss, dtype=float)]
    names = ["N", "Σ l²"]
    if per_document:
        cols.append(np.asarray(ds, dtype=float))
        names.append("the document count")
    if intercept:
        cols.append(np.ones(len(ns)))
        names.append("the constant")
    x = np.stack(cols, axis=1)
    norms = np.abs(x).max(axis=0)  # scale columns so the rank test is unit-free
    xs = x / norms
    sv = np.linalg.svd(xs, compute_uv=False)
    if sv[-1] <= 1e-9 * sv[0]:
        what = ", ".join(names[:-1]) + " and " + names[-1]
        raise CostModelError(
            f"warm-up design is rank-deficient: {what} are linearly dependent across the "
            f"{len(samples)} samples (e.g. all documents have the same length), so β cannot "
            "be identified; warm up on micro-batches with varied document lengths"
        )
    coef_f = np.linalg.lstsq(xs, np.asarray(tf), rcond=None)[0] / norms
    coef_b = np.linalg.lstsq(xs, np.asarray(tb), rcond=None)[0] / norms
    fw = dict(zip(names, (float(c) for c in coef_f)))
    bw = dict(zip(names, (float(c) for c in coef_b)))
    return StageCost(
        alpha_f=fw["N"],
        beta_f=fw["Σ l²"],
        gamma_f=fw.get("the constant", 0.0),
        delta_f=fw.get("the document count", 0.0),
        alpha_b=bw["N"],
        beta_b=bw["Σ l²"],
        gamma_b=bw.get("the constant", 0.0),
        delta_b=bw.get("the document count", 0.0),
        ref_layers=ref_layers,
        ref_tp=ref_tp,
        w_fraction=w_fraction,
    )


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent."""
    if len(predicted) != len(measured) or not measured:
        raise CostModelError(
            f"mape needs two equal-length non-empty sequences, got {len(predicted)} and {len(measured)}"
        )
    if any(m <= 0 for m in measured):
        raise CostModelError("mape needs measured values > 0")
    return 100.0 * sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured)


@dataclass(frozen=True)
class CostModel:
    """Per-stage costs of a pipeline; ``stages[s]`` costs stage ``s`` (by position)."""

    stages: tuple[StageCost, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise CostModelError("CostModel needs at least one StageCost")
        for s, c in enumerate(self.stages):
            if not isinstance(c, StageCost):
                raise CostModelError(f"stage {s}: expected StageCost, got {type(c).__name__}")

    @classmethod
    def uniform(cls, stage_cost: StageCost, num_stages: int) -> CostModel:
        """Every stage costs the same per layer (embedding/head cost ignored)."""
        if num_stages < 1:
            raise CostModelError(f"num_stages must be >= 1, got {num_stages}")
        return cls((stage_cost,) * num_stages)

    def stage(self, s: int) -> StageCost:
        if not 0 <= s < len(self.stages):
            raise CostModelError(f"no cost for stage {s}; the model has {len(self.stages)} stages")
        return self.stages[s]


def group_speed(group: Sequence[int], speeds: Mapping[int, float] | None) -> float:
    """A TP group runs at its slowest member's normalised throughput (missing = 1.0)."""
    if not group:
        raise CostModelError("an empty TP group has no speed")
    ps = [1.0 if speeds is None else speeds.get(d, 1.0) for d in group]
    for d, p in zip(group, ps):
        if not (isinstance(p, (int, float)) and math.isfinite(p) and p > 0):
            raise CostModelError(f"device {d}: normalised throughput must be > 0, got {p!r}")
    return min(ps)


def vertex_times(
    plan: ParallelPlan,
    workload: Workload,
    cost: CostModel,
    speeds: Mapping[int, float] | None = None,
    *,
    split: bool | None = None,
) -> dict[VertexKey, float]:
    """Compute seconds of every pipeline vertex of one iteration under ``plan``.

    Keys are ``(kind, executing replica, stage, owner replica, mb)``. With ``split``
    (default: the plan's schedule is zero-bubble) kind is 'F', 'B' (input gradient) or
    'W' (weight gradient); otherwise 'F' and 'B' (the full backward). Each vertex is
    costed at the executing TP group's degree and slowest device speed, and at the
    stage's layer count in ``plan``.
    """
    if len(cost.stages) != plan.pp:
        raise CostModelError(f"cost model has {len(cost.stages)} stages, plan has {plan.pp}")
    if split is None:
        split = plan.schedule == ScheduleKind.ZB_H1
    out: dict[VertexKey, float] = {}
    group_cache: dict[tuple[int, int], tuple[int, float]] = {}
    for (stage, owner, mb), ex in plan.executor_map().items():
        key = (ex, stage)
        if key not in group_cache:
            g = plan.group(ex, stage)
            group_cache[key] = (len(g), group_speed(g, speeds))
        tp, p = group_cache[key]
        try:
            lengths = workload[(owner, mb)]
        except KeyError:
            raise CostModelError(f"workload has no micro-batch (replica {owner}, mb {mb})") from None
        sc = cost.stages[stage]
        kw = dict(layers=plan.layers(stage), tp=tp, speed=p)
        out[("F", ex, stage, owner, mb)] = sc.forward(lengths, **kw)
        if split:
            out[("B", ex, stage, owner, mb)] = sc.backward_input(lengths, **kw)
            out[("W", ex, stage, owner, mb)] = sc.backward_weight(lengths, **kw)
        else:
            out[("B", ex, stage, owner, mb)] = sc.backward(lengths, **kw)
    return out


def activation_bytes(tokens: int, hidden: int, dtype_bytes: int = 2) -> int:
    """Bytes of one [tokens, hidden] activation (what stages and TP all-reduces move)."""
    return tokens * hidden * dtype_bytes


@dataclass(frozen=True)
class LinkModel:
    """Latency-bandwidth (α-β) model of intra-node and inter-node links.

    Defaults follow the docs/design.md's evaluation nodes: NVSwitch inside a node (~300 GB/s,
    ~5 µs) and 200 Gb/s InfiniBand between nodes (25 GB/s, ~10 µs), one NIC per GPU.
    """

    intra_bandwidth: float = 300e9
    inter_bandwidth: float = 25e9
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6

    def __post_init__(self) -> None:
        _positive("intra_bandwidth", self.intra_bandwidth)
        _positive("inter_bandwidth", self.inter_bandwidth)
        for name in ("intra_latency", "inter_latency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise CostModelError(f"{name} must be a finite number >= 0, got {v!r}")

    def _link(self, same_node: bool) -> tuple[float, float]:
        if same_node:
            return self.intra_latency, self.intra_bandwidth
        return self.inter_latency, self.inter_bandwidth

    def p2p(self, nbytes: float, same_node: bool) -> float:
        """One point-to-point message: latency + bytes / bandwidth (0 for no bytes)."""
        if nbytes < 0:
            raise CostModelError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return 0.0
        lat, bw = self._link(same_node)
        return lat + nbytes / bw

    def allreduce(self, nbytes: float, n: int, same_node: bool) -> float:
        """Ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n-1)/n·bytes/bw + 2(n-1)·lat."""
        if n < 1 or nbytes < 0:
            raise CostModelError(f"allreduce needs n >= 1 and nbytes >= 0, got n={n}, nbytes={nbytes}")
        if n == 1 or nbytes == 0:
            return 0.0
        lat, bw = self._link(same_node)
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    def allgather(self, nbytes: float, n: int, same_node: bool) -> float:
        """Ring all-gather whose result is ``nbytes``: (n-1)/n·bytes/bw + (n-1)·lat."""
        if n < 1 or nbytes < 0:
            raise CostModelError(f"allgather needs n >= 1 and nbytes >= 0, got n={n}, nbytes={nbytes}")
        if n == 1 or nbytes == 0:
            return 0.0
        lat, bw = self._link(same_node)
        return (n - 1) / n * nbytes / bw + (n - 1) * lat

    def tp_per_layer(
        self, tokens: int, hidden: int, tp: int, *, dtype_bytes: int = 2, allreduces: int = 2,
        same_node: bool = True,
    ) -> float:
        """TP communication of one layer for one pass (forward or backward).

        Megatron-style TP all-reduces the [tokens, hidden] activation twice per layer
        and pass (after attention and after the MLP).
        """
        return allreduces * self.allreduce(activation_bytes(tokens, hidden, dtype_bytes), tp, same_node)

    def stage_p2p(
        self, nbytes: float, send_degree: int, recv_degree: int, *, same_node: bool = False
    ) -> float:
        """Activation (or gradient) transfer between stages of TP degrees that may differ.

        docs/design.md §5.1: with N = max(degrees), the sender splits the tensor into N chunks and
        each chunk crosses the link once; the receivers then all-gather inside their
        node. Chunks travel in parallel over per-GPU links; a side with fewer GPUs
        handles ceil(N / its degree) chunks per GPU, which sets the transfer time.
        """
        if send_degree < 1 or recv_degree < 1:
            raise CostModelError(
                f"TP degrees must be >= 1, got send={send_degree}, recv={recv_degree}"
            )
        if nbytes < 0:
            raise CostModelError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return 0.0
        n = max(send_degree, recv_degree)
        chunks_per_gpu = math.ceil(n / min(send_degree, recv_degree))
        lat, bw = self._link(same_node)
        send = chunks_per_gpu * (lat + nbytes / n / bw)
        return send + self.allgather(nbytes, recv_degree, True)
