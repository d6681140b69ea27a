"""Re-sharding plans move every shard of parameters and AdamW state exactly, for any
old/new TP degrees and layer partitions (executed in-process, no communication)."""

from __future__ import annotations


import pytest
import torch

from resihp_core.plan import ParallelPlan, ranges_from_counts
from resihp_adapters.megatron_ref import state
from resihp_adapters.megatron_ref.model import ModelConfig, init_parameter, shard_dim

CFG = ModelConfig(vocab_size=64, hidden=32, num_heads=4, ffn_hidden=64, num_layers=4, dtype="float64")


def _full():
    out = {}
    for comp in ["embed", "head"] + [f"layers.{i}" for i in range(CFG.num_layers)]:
        for name in state.param_names(CFG, comp):
            p = init_parameter(CFG, name)
            out[name] = (p, p * 2 + 1, p.abs() + 3)
    return out


def _shards(plan, full):
    """device -> {name: (param, m, v)} shards that plan places on it."""
    out = {}
    for r, s in plan.executors():
        g = plan.group(r, s)
        for t, dev in enumerate(g):
            mine = {}
            for comp in state.components_of_stage(plan, s):
                for name in state.param_names(CFG, comp):
                    d = shard_dim(name)
                    mine[name] = tuple(x.clone() if d is None else x.chunk(len(g), d)[t].clone() for x in full[name])
            out[dev] = mine
    return out


def _execute(old, new, alive, full):
    before = _shards(old, full)
    after = {dev: {n: tuple(torch.full_like(x, float("nan")) for x in ts) for n, ts in sh.items()}
             for dev, sh in _shards(new, full).items()}
    plan = state.transfer_plan(old, new, alive)
    moved = {(tr.component, tr.dst) for tr in plan}
    for dev, sh in after.items():
        for name, ts in sh.items():
            if (state.component_of(name), dev) not in moved:
                for a, b in zip(ts, before[dev][name]):
                    a.copy_(b)
    for tr in plan:
        assert tr.src in alive
        buf = state.pack(CFG, tr, before[tr.src])
        assert buf.numel() == state.transfer_numel(CFG, tr)
        state.unpack(CFG, tr, buf, after[tr.dst])
    return after, plan


PLANS = [
    ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=2, num_heads=4),
    ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2, num_heads=4),
    ParallelPlan.uniform(tp=4, pp=1, dp=2, num_layers=4, num_microbatches=2, num_heads=4),
]


def _variants(p):
    yield p
    yield p.with_(layer_ranges=ranges_from_counts([3, 1]) if p.pp == 2 else p.layer_ranges)
    groups = [list(rep) for rep in p.tp_groups]
    if len(groups[1][0]) > 1:
        groups[1][0] = groups[1][0][: len(groups[1][0]) // 2]
        yield p.with_(tp_groups=tuple(tuple(r) for r in groups))


@pytest.mark.parametrize("old", PLANS)
def test_resharding_reproduces_the_target_layout(old):
    full = _full()
    for new in _variants(old):
        after, _ = _execute(old, new, old.devices(), full)
        assert after.keys() == _shards(new, full).keys()
        for dev, sh in _shards(new, full).items():
            for name, ts in sh.items():
                for got, want in zip(after[dev][name], ts):
                    assert torch.equal(got, want), (dev, name)


def test_lost_device_sources_from_another_replica_and_nothing_is_kept_by_the_dead():
    old = PLANS[0]
    dead = old.group(0, 1)[1]
    groups = [list(rep) for rep in old.tp_groups]
    groups[0][1] = groups[0][1][:1]
    new = old.with_(tp_groups=tuple(tuple(r) for r in groups), excluded=frozenset([dead]))
    alive = [d for d in old.devices() if d != dead]
    full = _full()
    after, plan = _execute(old, new, alive, full)
    assert all(tr.src != dead for tr in plan)
    src_groups = {tr.src for tr in plan if tr.dst == old.group(0, 1)[0]}
    assert src_groups <= set(old.group(1, 1))
    for name, ts in _shards(new, full)[old.group(0, 1)[0]].items():
        assert all(torch.equal(a, b) for a, b in zip(after[old.group(0, 1)[0]][name], ts))


def test_no_surviving_copy_is_a_lookup_error():
    old = PLANS[1]
    dead = [old.group(0, 1)[0], old.group(1, 1)[0]]
    alive = [d for d in old.devices() if d not in dead]
    new = old.with_(tp_groups=(((alive[0],),), ((alive[1],),)), layer_ranges=((0, 4),))
    with pytest.raises(LookupError, match="no surviving complete copy of layers.2"):
        state.transfer_plan(old, new, alive)
