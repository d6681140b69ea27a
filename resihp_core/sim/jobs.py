"""The model-scale jobs the cluster simulator, benchmarks and tests plan for: SPEC §7's scales.

:func:`job_state` builds a :class:`~resihp_core.scheduler.state.PlannerState` for a LLaMA-2-like model on
nodes of 8 devices (NVSwitch inside, 200 Gb/s InfiniBand between): an analytic cost
model (FLOPs at an assumed sustained device rate), the iteration's packed workload
from the synthetic long-tailed corpus, and a memory model (mixed-precision Adam: 16
bytes of state per parameter; about 34 bytes of activations per token and hidden unit
per layer, sharded over the TP group). The numbers are plausible, not measured: they
give the planner realistic proportions (compute vs. communication vs. memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from resihp_core.adapter import Capabilities
from resihp_core.plan import ParallelPlan, ScheduleKind, Topology
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
from resihp_core.scheduler.state import MemoryModel, PlannerState

__all__ = ["ModelSpec", "MODELS", "TOY_FORWARD_S", "job_state", "toy_state"]

GIB = float(1 << 30)

#: :func:`toy_state`: forward seconds of one layer of one micro-batch at TP 1 (the
#: backward takes twice that).
TOY_FORWARD_S = 1e-3


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only model: layers, hidden size, parameters per layer, heads."""

    name: str
    layers: int
    hidden: int
    params_per_layer: float
    heads: int


MODELS: dict[str, ModelSpec] = {
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 202e6, 32),
    "llama2-13b": ModelSpec("llama2-13b", 40, 5120, 317e6, 40),
    "llama-30b": ModelSpec("llama-30b", 60, 6656, 543e6, 52),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 856e6, 64),
}


def job_state(
    *,
    tp: int,
    pp: int,
    dp: int,
    num_microbatches: int,
    model: str | ModelSpec = "llama2-7b",
    tokens: int = 4096,
    devices_per_node: int = 8,
    memory_gib: float = 80.0,
    flops: float = 250e12,
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B,
    capabilities: Capabilities | None = None,
    memory: MemoryModel | None = None,
    delta: float = 1.0,
    k_min: int = 1,
    seed: int = 0,
    iteration: int = 0,
) -> PlannerState:
    """A healthy job running the uniform (tp, pp, dp) plan (see module docstring)."""
    spec = MODELS[model] if isinstance(model, str) else model
    n = tp * pp * dp
    nodes = -(-n // devices_per_node)
    topology = Topology.uniform(nodes, devices_per_node, memory_gib)
    plan = ParallelPlan.uniform(
        tp=tp, pp=pp, dp=dp, num_layers=spec.layers, num_microbatches=num_microbatches,
        schedule=schedule, num_heads=spec.heads,
    )
    # Per layer, TP 1, healthy: forward 2·P FLOPs per token plus causal attention
    # 2·h FLOPs per (query, key) pair, i.e. per l² of each document; backward twice that.
    alpha_f = 2.0 * spec.params_per_layer / flops
    beta_f = 2.0 * spec.hidden / flops
    cost = CostModel.uniform(
        StageCost(alpha_f=alpha_f, beta_f=beta_f, alpha_b=2 * alpha_f, beta_b=2 * beta_f,
                  ref_layers=1, ref_tp=1),
        pp,
    )
    shape = ModelShape(
        tokens=tokens, hidden=spec.hidden, params_per_layer=int(spec.params_per_layer),
        dtype_bytes=2, grad_bytes=2, optimizer_s_per_param=16.0 / 2e12,
    )
    predictor = IterationPredictor(cost, topology, shape)
    corpus = CorpusSpec(token_budget=tokens, seed=seed)
    features = workload_features(iteration_workload(corpus, iteration, dp, num_microbatches),
                                 dp, num_microbatches)
    if memory is None:
        memory = MemoryModel(
            layer_state_gib=16.0 * spec.params_per_layer / GIB,
            layer_activation_gib=34.0 * tokens * spec.hidden / GIB,
            reserve_gib=4.0,
        )
    return PlannerState.create(
        topology, plan, predictor, features, memory=memory, capabilities=capabilities,
        k_min=k_min, delta=delta,
    )


def toy_state(
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    m: int = 4,
    layers: int | None = None,
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B,
    devices_per_node: int = 8,
    memory_gib: float = 80.0,
    memory: MemoryModel | None = None,
    extra_devices: int = 0,
    capabilities: Capabilities | None = None,
    speeds: dict[int, float] | None = None,
    effort: str = "thorough",
) -> PlannerState:
    """A job whose times are easy to compute by hand (tests, examples): every
    micro-batch costs the same (fixed-length documents), communication is free, and one
    layer of one micro-batch takes :data:`TOY_FORWARD_S` forward and twice that
    backward at TP 1 on a healthy device. ``extra_devices`` adds spare devices to the
    topology (not in the plan)."""
    layers = layers or pp
    n = tp * pp * dp + extra_devices
    topology = Topology.uniform(-(-n // devices_per_node), devices_per_node, memory_gib)
    plan = ParallelPlan.uniform(tp=tp, pp=pp, dp=dp, num_layers=layers, num_microbatches=m,
                                schedule=schedule)
    tokens = 1024
    cost = CostModel.uniform(
        StageCost(alpha_f=TOY_FORWARD_S / tokens, beta_f=0.0,
                  alpha_b=2 * TOY_FORWARD_S / tokens, beta_b=0.0),
        pp,
    )
    free = LinkModel(intra_bandwidth=1e30, inter_bandwidth=1e30, intra_latency=0.0,
                     inter_latency=0.0)
    predictor = IterationPredictor(
        cost, topology, ModelShape(tokens=tokens, hidden=8, params_per_layer=1), free)
    corpus = CorpusSpec(distribution="fixed", scale=256, token_budget=tokens)
    features = workload_features(iteration_workload(corpus, 0, dp, m), dp, m)
    return PlannerState.create(topology, plan, predictor, features, memory=memory,
                               capabilities=capabilities, speeds=speeds, effort=effort)
