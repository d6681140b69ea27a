"""Plan sequences for the DeepSpeed adapter's tests and the single-process reference they
are checked against (float64, the same micro-batch accounting: each iteration trains on
micro-batches (iteration, r, j) for the plan's replicas r and j < num_microbatches)."""

from __future__ import annotations

from resihp_core.plan import Migration, ParallelPlan

LAYERS, MB, MBS, DP, LR, SEED = 6, 4, 2, 2, 1e-3, 7


def generations() -> list[tuple[ParallelPlan, int]]:
    """(plan, iterations) for every generation of the multi-generation scenario:
    fault-free PP2 x DP2; DP work migration (replica 0's micro-batches 2 and 3 run on
    replica 1 at every stage, and one stage-1 piece moves the other way); layer
    repartition; replica drop (devices 0 and 2 become standbys); the standbys rejoin
    with a second repartition."""
    p0 = ParallelPlan.uniform(tp=1, pp=2, dp=DP, num_layers=LAYERS, num_microbatches=MB)
    moved = tuple(Migration(s, 0, j, 1) for s in range(2) for j in (2, 3)) + (Migration(1, 1, 0, 0),)
    p1 = p0.with_(generation=1, migrations=moved)
    p2 = p0.with_(generation=2, layer_ranges=((0, 2), (2, 6)))
    p3 = p2.with_(generation=3, tp_groups=(((1,), (3,)),), standbys=(0, 2))
    p4 = p2.with_(generation=4, layer_ranges=((0, 4), (4, 6)), tp_groups=(((1,), (3,)), ((0,), (2,))))
    return [(p0, 2), (p1, 2), (p2, 1), (p3, 1), (p4, 1)]


def reference(replicas_per_iteration: list[int], *, hidden: int | None = None, micro_batch_size: int = MBS):
    """Per-layer parameters and per-iteration losses of the same training in one process
    (``hidden`` and ``micro_batch_size`` as the job's ``adapter_config`` gave them)."""
    import sys
    import os

    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    import _model as M
    from resihp_adapters.deepspeed.data import MicroBatchSource

    torch.set_default_dtype(torch.float64)
    h = hidden or M.H
    blocks = []
    for idx in range(LAYERS):
        torch.manual_seed(SEED + idx)
        blocks.append(M.Block(h))
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    src = MicroBatchSource(M.Samples(h=h), MicroBatchSource.default_collate, micro_batch_size, MB, DP)
    losses = []
    params = list(model.parameters())
    for it, dp in enumerate(replicas_per_iteration):
        # As DeepSpeed: each replica accumulates loss / MB, then the DP average.
        per_replica, total = [], 0.0
        for r in range(dp):
            opt.zero_grad()
            for j in range(MB):
                x, y = src.micro_batch(it, r, j)
                loss = M.mse(model(x), y)
                (loss / MB).backward()
                total += float(loss.detach())
            per_replica.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in per_replica) / dp
        opt.step()
        losses.append(total / (MB * dp))
    return {f"{i}.fc.{n}": getattr(b.fc, n).detach().clone() for i, b in enumerate(blocks) for n in ("weight", "bias")}, losses
