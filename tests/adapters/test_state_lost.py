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
