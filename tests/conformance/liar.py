"""Adapters that break the contract on purpose; the conformance kit must fail each."""

import os

import torch
from resihp_example_adapter.adapter import ExampleAdapter

from resihp_adapters.megatron_ref.adapter import MegatronRefAdapter


class SkipsMigrated(ExampleAdapter):
    """Declares cross-replica migration but skips migrated micro-batches."""

    def _computes(self, op) -> bool:
        return op.owner == self.where[0]


class OwnCheckpointLayout(ExampleAdapter):
    """Writes checkpoints in a layout of its own (no iteration folder, no manifest):
    the supervisor cannot find them, so a restore would start from the seed."""

    def save_checkpoint(self, iteration):
        if self.ctx.device != min(self.plan.devices()):
            return
        os.makedirs(self.ctx.job.checkpoint_dir, exist_ok=True)
        torch.save({"weight": self.weight.detach(), "opt": self.opt.state_dict()},
                   os.path.join(self.ctx.job.checkpoint_dir, f"mine-{iteration}.pt"))

    def load_checkpoint(self, iteration, plan):
        ck = torch.load(os.path.join(self.ctx.job.checkpoint_dir, f"mine-{iteration}.pt"))
        with torch.no_grad():
            self.weight.copy_(ck["weight"])
        self.opt.load_state_dict(ck["opt"])
        self.plan = plan


class StepDecay(MegatronRefAdapter):
    """Honest: the reference backend with an LR schedule of its own (x0.8 per optimizer
    step) whose position it keeps, as torch's ``LRScheduler.last_epoch``, and reports
    in ``full_state``. The fault-free baseline of the liars below."""

    DECAY = 0.8

    def __init__(self, ctx):
        super().__init__(ctx)
        self.base_lr = self.optimizer.lr
        self.sched_pos = self._snapshot_pos = 0

    def _schedule(self):
        self.optimizer.lr = self.base_lr * self.DECAY ** self.sched_pos
        self.sched_pos += 1

    def _step_number(self, iteration):
        self._schedule()
        return super()._step_number(iteration)

    def full_state(self):
        return {**super().full_state(), "lr_scheduler.last_epoch": self.sched_pos}

    def snapshot(self):
        super().snapshot()
        self._snapshot_pos = self.sched_pos

    def rollback(self):
        if self._snapshot is not None:
            self.sched_pos = self._snapshot_pos
            self.optimizer.lr = self.base_lr * self.DECAY ** max(0, self.sched_pos - 1)
        super().rollback()

    def start_fresh(self, plan):
        super().start_fresh(plan)
        self.sched_pos = 0

    def load_checkpoint(self, iteration, plan):
        super().load_checkpoint(iteration, plan)
        self.sched_pos = iteration + 1
        self.optimizer.lr = self.base_lr * self.DECAY ** iteration


class DropsOptimizerTensor(StepDecay):
    """Moves parameters and optimizer state, except one tensor: the second AdamW moment
    of the first parameter it holds starts again from zero."""

    def move_state(self, old_plan, new_plan, devices):
        n = super().move_state(old_plan, new_plan, devices)
        held = sorted(self.optimizer.state)
        if held:
            self.optimizer.state[held[0]][1].zero_()
        return n


class LosesStepOnMove(StepDecay):
    """Counts AdamW steps itself and forgets the count when state moves (as an
    optimizer rebuilt without its ``state_dict`` would)."""

    def _step_number(self, iteration):
        self._schedule()
        return self.steps + 1

    def move_state(self, old_plan, new_plan, devices):
        n = super().move_state(old_plan, new_plan, devices)
        self.steps = 0
        return n


class ForgetsScheduleOnMove(StepDecay):
    """Moves every tensor but rebuilds its LR scheduler when state moves, so the
    schedule starts again from its first step (a scheduler not carried over)."""

    def move_state(self, old_plan, new_plan, devices):
        n = super().move_state(old_plan, new_plan, devices)
        self.sched_pos = 0
        return n
