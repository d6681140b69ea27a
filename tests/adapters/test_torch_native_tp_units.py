"""torch_native's tensor parallelism without processes: world ranks of a heterogeneous
plan, the boundary peers of stages of different TP degree (every receiver has exactly
one sender, every send has its receive), the model's own HF TP plan and what is
refused up front."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_adapters.torch_native.engine import place_of  # noqa: E402
from resihp_adapters.torch_native.tp import (  # noqa: E402
    check_tp_plan, executor_ranks, model_tp_plan, stage_peers, tp_styles, uses_tp)


def hetero(*groups: tuple[int, ...], layers: int = 4) -> ParallelPlan:
    n = len(groups)
    per = layers // n
    ranges = tuple((s * per, layers if s == n - 1 else (s + 1) * per) for s in range(n))
    return ParallelPlan(num_layers=layers, layer_ranges=ranges, tp_groups=(tuple(groups),), num_microbatches=2)


def test_ranks_are_stage_major_and_place_of_agrees():
    plan = hetero((4, 5), (6,), (0, 1, 2, 3))
    ranks = executor_ranks(plan)
    assert ranks == {(0, 0, 0): 0, (0, 0, 1): 1, (0, 1, 0): 2, (0, 2, 0): 3, (0, 2, 1): 4, (0, 2, 2): 5,
                     (0, 2, 3): 6}
    for (r, s, t), rank in ranks.items():
        pl = place_of(plan, plan.group(r, s)[t], 0)
        assert (pl.rank, pl.stage, pl.tp_index, pl.tp_degree) == (rank, s, t, plan.degree(r, s))
    assert uses_tp(plan) and not uses_tp(ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2))
    # without TP the ranks are the FSDP engine's own: stage * dp + replica
    flat = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)
    assert [place_of(flat, d, 0).rank for d in flat.devices()] == [0, 2, 1, 3]


@pytest.mark.parametrize("degrees", [(2, 1), (1, 2), (2, 2), (4, 2, 1), (1, 4), (2, 4, 2)])
def test_every_receiver_has_one_sender_and_every_send_a_receive(degrees):
    groups, d = [], 0
    for k in degrees:
        groups.append(tuple(range(d, d + k)))
        d += k
    plan = hetero(*groups, layers=4 if len(degrees) < 3 else 6)
    ranks = executor_ranks(plan)
    sends, recvs = set(), set()
    for (r, s, t), rank in ranks.items():
        peers = stage_peers(plan, r, s, t)
        for nb, src in peers.recv_from.items():
            recvs.add((src, rank, nb < s))  # (from, to, forward direction)
        for nb, dsts in peers.send_to.items():
            sends.update((rank, dst, nb > s) for dst in dsts)
    assert sends == recvs
    for s in range(1, plan.pp):  # forward: each rank of stage s receives once, from stage s-1
        for t in range(plan.degree(0, s)):
            assert sum(1 for (a, b, fwd) in recvs if fwd and b == ranks[(0, s, t)]) == 1
    for s in range(plan.pp - 1):  # backward: each rank of stage s receives its output's gradient once
        for t in range(plan.degree(0, s)):
            assert sum(1 for (a, b, fwd) in recvs if not fwd and b == ranks[(0, s, t)]) == 1


def _hf():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_the_models_own_tp_plan_and_refusals():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = _hf()
    plan = model_tp_plan(model)
    assert plan["model.layers.*.self_attn.k_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    styles = tp_styles(plan)
    assert isinstance(styles["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(styles["model.layers.*.self_attn.o_proj"], RowwiseParallel)
    with pytest.raises(ValueError, match="'model.layers.*.mlp.up_proj'.*packed"):
        tp_styles({"model.layers.*.mlp.up_proj": "packed"})
    with pytest.raises(ValueError, match="carries no TP plan"):
        model_tp_plan(torch.nn.Linear(2, 2))
    assert model_tp_plan(torch.nn.Linear(2, 2), {"x": "colwise"}) == {"x": "colwise"}
    # 4 heads, 2 KV heads: TP 4 splits the KV heads unevenly; refused naming them
    with pytest.raises(ValueError, match="TP degree 4 does not divide config.num_key_value_heads = 2"):
        check_tp_plan(hetero((0, 1, 2, 3), (4,)), model, plan)
    check_tp_plan(hetero((0, 1), (2,)), model, plan)
    two = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=2)
    with pytest.raises(ValueError, match="one replica"):
        check_tp_plan(two, model, plan)


def test_resihp_run_refuses_tp_with_several_replicas_up_front():
    from types import SimpleNamespace

    from resihp_adapters.torch_native.plugin import job_section

    cfg = SimpleNamespace(model=None, training=None, adapter={}, parallel=SimpleNamespace(tp=2, pp=2, dp=2))
    with pytest.raises(ValueError, match="tensor parallelism with one replica"):
        job_section(cfg)


def test_busy_timer_counts_work_not_waiting_for_a_peer():
    """A TP rank's chunk time leaves out the time it slept in a collective waiting for a
    slow peer (so the verifier can tell the slow member from the waiting one) and keeps
    its own work."""
    import os
    import threading
    import time

    from resihp_adapters.torch_native.tp import BusyTimer

    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("no schedstat: the timer falls back to the wall clock")
    peer = threading.Event()
    threading.Timer(0.3, peer.set).start()
    t = BusyTimer().start()
    peer.wait()  # blocked, as in gloo's wait for a peer's contribution
    waited = t.stop()
    t = BusyTimer().start()
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:  # computing
        pass
    busy = t.stop()
    assert waited < 0.1, waited
    assert busy >= 0.15, busy  # CPU time plus any wait for a CPU: the wall time of the work


def test_capabilities_say_tp_with_one_replica_and_the_scheduler_keeps_to_it():
    """torch_native declares TP resize and heterogeneous TP with one replica only
    (``tp_with_dp = False``): a TP x DP plan is ruled out by name, and a restore that
    would pick TP2 x DP2 on the survivors (what an adapter with TP x DP gets) picks TP 1
    there instead."""
    from dataclasses import replace

    from resihp_adapters.torch_native.plugin import CAPABILITIES
    from resihp_core.protocol import FailureReport
    from resihp_core.scheduler import DEFAULT_STAGES, Planner
    from resihp_core.sim.jobs import toy_state

    assert CAPABILITIES.heterogeneous_tp and CAPABILITIES.tp_resize and not CAPABILITIES.tp_with_dp
    two = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=2)
    assert any("needs tp_with_dp" in w for w in CAPABILITIES.violations(two))
    assert not CAPABILITIES.violations(hetero((0, 1), (2,)))
    assert not CAPABILITIES.violations(ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2))
    got = {}
    for caps in (replace(CAPABILITIES, tp_with_dp=True), CAPABILITIES):
        st = toy_state(tp=2, pp=2, dp=1, m=4, devices_per_node=4, extra_devices=8, capabilities=caps)
        d = Planner(stages=DEFAULT_STAGES).plan(st, FailureReport(generation=0, failure="fail-stop",
                                                                   devices=tuple(st.plan.group(0, 1))))
        got[caps.tp_with_dp] = (d.kind, d.plan.dp, {d.plan.degree(r, s) for r, s in d.plan.executors()})
        assert not caps.violations(d.plan)
    assert got[True] == ("restore", 2, {2}) and got[False] == ("restore", 4, {1}), got
