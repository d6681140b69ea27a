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


class DropsOptimizerTensor(MegatronRefAdapter):
    """Moves parameters and optimizer state, except one tensor: the second AdamW moment
    of the first parameter it holds starts again from zero."""

    def move_state(self, old_plan, new_plan, devices):
        n = super().move_state(old_plan, new_plan, devices)
        held = sorted(self.optimizer.state)
        if held:
            self.optimizer.state[held[0]][1].zero_()
        return n


class LosesStepOnMove(MegatronRefAdapter):
    """Counts AdamW steps itself and forgets the count when state moves (as an
    optimizer rebuilt without its ``state_dict`` would)."""

    def _step_number(self, iteration):
        return self.steps + 1

    def move_state(self, old_plan, new_plan, devices):
        n = super().move_state(old_plan, new_plan, devices)
        self.steps = 0
        return n
