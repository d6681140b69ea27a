"""Every first-party adapter's "no surviving copy" error is the contract's StateLost, the
one typed signal the worker reports and the supervisor restores on (no error text)."""

from __future__ import annotations

import pytest

from resihp_core.adapter import StateLost
from resihp_core.plan import ParallelPlan

pytest.importorskip("torch")


def test_torchkit_and_megatron_ref_raise_the_contract_exception():
    from resihp_adapters.megatron_ref import state

    old = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)
    dead = {old.group(0, 1)[0], old.group(1, 1)[0]}  # every copy of stage 1
    alive = [d for d in old.devices() if d not in dead]
    new = old.with_(tp_groups=(((alive[0],),), ((alive[1],),)), layer_ranges=((0, 4),))
    with pytest.raises(StateLost, match="no surviving complete copy"):
        state.transfer_plan(old, new, alive)


def test_torch_native_and_deepspeed_state_lost_are_the_contract_exception():
    from resihp_adapters.deepspeed.state import LayersLost
    from resihp_adapters.torch_native.reshard import StateLost as ShardLost

    assert issubclass(ShardLost, StateLost) and issubclass(LayersLost, StateLost)


def test_torch_native_move_check_counts_a_live_device_the_new_plan_drops_as_a_sender():
    """A fail-slow re-plan that drops a slow device from a sharded DP job: the device is
    alive and in the new world (a standby), so its shard moves from it; only a dead
    holder loses the state (then the job would restore from a checkpoint, or start over)."""
    from types import SimpleNamespace

    from resihp_adapters.torch_native.engine import TorchNativeEngine
    from resihp_adapters.torch_native.reshard import StateLost as ShardLost

    old = ParallelPlan.uniform(tp=1, pp=1, dp=4, num_layers=4, num_microbatches=2)
    slow = old.group(2, 0)[0]
    kept = [d for d in old.devices() if d != slow]
    new = old.with_(tp_groups=tuple(((d,),) for d in kept))
    engine = SimpleNamespace(iteration=5, wanted_shard=4, stage_names=lambda plan, s: ["w", "w.exp_avg"])
    TorchNativeEngine.check_move(engine, old, new, set(old.devices()))  # the slow device sends its shard
    with pytest.raises(ShardLost, match="shard 2/4 of stage 0 .* held only by dead devices"):
        TorchNativeEngine.check_move(engine, old, new, set(kept))  # it died: its shard has no copy
