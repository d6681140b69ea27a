"""A generation whose state has no live copy is left before any rendezvous: the worker
asks the adapter's ``check_move`` first, so every device (each computes the same answer
from the two plans) says "state lost" together and none is left connecting to peers that
already went (docs/adapters.md, the lifecycle)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from resihp_core.adapter import Adapter, AdapterContext, IterationResult, Shard  # noqa: E402
from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_core.protocol import PlanUpdate  # noqa: E402
from resihp_core.runtime import session  # noqa: E402
from resihp_core.runtime.store import LocalStore, _Table  # noqa: E402
from resihp_core.runtime.worker import Worker  # noqa: E402
from resihp_adapters.megatron_ref.adapter import MegatronRefAdapter  # noqa: E402


class Recording(Adapter):
    """Records the lifecycle calls; its move check is megatron_ref's own plan arithmetic."""

    name = "recording"

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.calls: list[str] = []

    check_move = MegatronRefAdapter.check_move

    def rebuild_communicators(self, plan, generation, devices):
        self.calls.append(f"rebuild {generation}")

    def start_fresh(self, plan):
        self.calls.append("fresh")

    def move_state(self, old_plan, new_plan, devices):
        self.calls.append("move")
        return 0

    def load_checkpoint(self, iteration, plan):
        self.calls.append(f"load {iteration}")

    def run_iteration(self, program, iteration):
        return IterationResult(iteration)

    def snapshot(self):
        pass

    def rollback(self):
        pass

    def release(self):
        self.calls.append("release")

    def held_state(self) -> dict[str, Shard]:
        return {}

    @property
    def where(self):
        return None


TP2_PP2 = ParallelPlan(num_layers=4, layer_ranges=((0, 2), (2, 4)), tp_groups=(((0, 1), (2, 3)),),
                       num_microbatches=2)


def _worker(device: int) -> tuple[Worker, LocalStore]:
    store = LocalStore(_Table(), timeout_s=5.0)
    w = Worker(device, store, JobSpec(adapter="recording", timeout_s=1.0), factory=Recording)
    w.plan = TP2_PP2  # the layout its state has
    return w, store


def _update(plan: ParallelPlan, devices: tuple[int, ...], **kw) -> PlanUpdate:
    return PlanUpdate(generation=1, plan=plan.with_(generation=1).to_text(), devices=devices, **kw)


def test_a_move_with_no_live_copy_leaves_before_the_rendezvous_as_state_lost():
    # Device 3 died: stage 1's TP shard it held has no other copy (one replica).
    after = TP2_PP2.with_(tp_groups=(((0, 1), (2,)),), excluded=frozenset([3]))
    for device in (0, 1, 2):  # every survivor reaches the same verdict on its own
        w, store = _worker(device)
        assert w._reconfigure(_update(after, (0, 1, 2))) is False
        assert w.adapter.calls == ["release"], "it must not enter the rendezvous"
        left = session.get_left(store, 1, device)
        assert left is not None and left.state_lost and left.error == "NoSurvivingCopy"


def test_a_move_with_live_copies_and_a_restore_enter_the_rendezvous():
    # Device 3 alive, the layers repartitioned: every shard has a live holder.
    moved = TP2_PP2.with_(layer_ranges=((0, 3), (3, 4)))
    w, _ = _worker(0)
    w._reconfigure(_update(moved, (0, 1, 2, 3)))
    assert w.adapter.calls == ["rebuild 1", "move"]
    # A restore reads the checkpoint: no live copy is needed, nothing is checked.
    after = TP2_PP2.with_(tp_groups=(((0, 1), (2,)),), excluded=frozenset([3]))
    w, _ = _worker(0)
    w._reconfigure(_update(after, (0, 1, 2), restore=9, resume=10))
    assert w.adapter.calls == ["rebuild 1", "load 9"]
