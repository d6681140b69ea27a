"""A small real adapter: data-parallel training of a linear model with torch.

Every executor holds a full replica (plans have one stage and TP degree 1). It runs the
micro-batches its program gives it -- its own and any migrated from a replica that lost
its device -- sums gradients over the executors and steps AdamW, so a replica can drop
out without changing training semantics. Data are generated from (seed, iteration,
global micro-batch), so any rank can compute any micro-batch. About sixty lines of
torch; copy it as the skeleton of your own adapter.
"""

from __future__ import annotations

import copy
import datetime
import os
import time

import torch
import torch.distributed as dist

from resihp_core import checkpoints
from resihp_core.adapter import Adapter, AdapterContext, IterationResult, Shard
from resihp_core.plan import ParallelPlan
from resihp_core.program import Forward, Program, ReduceGrads, OptimizerStep

from resihp_example_adapter.plugin import CAPABILITIES

FEATURES, ROWS = 8, 16  # one micro-batch: ROWS samples of FEATURES inputs


class ExampleAdapter(Adapter):
    name = "example"
    capabilities = CAPABILITIES

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        torch.set_num_threads(1)
        self.lr = float(ctx.job.adapter_config.get("lr", 0.05))
        self.weight = torch.zeros(1, FEATURES, dtype=torch.float64, requires_grad=True)
        self.opt = torch.optim.AdamW([self.weight], lr=self.lr)
        self.plan: ParallelPlan | None = None
        self.group = None  # the executors' reduction group
        self._saved = None

    @property
    def where(self):
        return self.plan.location(self.ctx.device) if self.plan is not None else None

    def rebuild_communicators(self, plan, generation, devices):
        self.release()
        store = dist.PrefixStore(f"gen{generation}/", self.ctx.store)
        timeout = datetime.timedelta(seconds=self.ctx.timeout_s)
        rank = sorted(devices).index(self.ctx.device)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=len(devices), timeout=timeout)
        self.ranks = {d: i for i, d in enumerate(sorted(devices))}
        self.group = dist.new_group([self.ranks[d] for d in sorted(plan.devices())], timeout=timeout)

    def release(self):
        self.group = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self):
        # The job's end: the group goes while the interpreter is whole (a gloo group left
        # to interpreter shutdown can abort the finished process).
        self.release()

    def start_fresh(self, plan):
        self.plan = plan
        with torch.no_grad():
            self.weight.copy_(torch.linspace(-1, 1, FEATURES, dtype=torch.float64))

    def move_state(self, old_plan, new_plan, devices):
        # Replicas are identical: the lowest surviving old executor broadcasts to all.
        src = min(d for d in old_plan.devices() if d in devices)
        tensors = [t for _, *ts in self._tensors() for t in ts]
        for t in tensors:
            dist.broadcast(t.data, self.ranks[src])
        self.plan = new_plan
        return 0 if self.ctx.device == src else sum(t.numel() * t.element_size() for t in tensors)

    def _tensors(self):
        st = self.opt.state.setdefault(self.weight, {})
        if not st:  # materialise AdamW's state so every replica has the same tensors
            st.update(step=torch.zeros((), dtype=torch.float64), exp_avg=torch.zeros_like(self.weight),
                      exp_avg_sq=torch.zeros_like(self.weight))
        return [("weight", self.weight, st["exp_avg"], st["exp_avg_sq"], st["step"])]

    def _batch(self, iteration, owner, mb):
        g = owner * self.plan.num_microbatches + mb  # global micro-batch: same data on any plan
        gen = torch.Generator().manual_seed(self.ctx.job.seed * 1_000_003 + iteration * 1009 + g)
        x = torch.randn(ROWS, FEATURES, generator=gen, dtype=torch.float64)
        return x, x.sum(1, keepdim=True) * 0.5 + 1.0

    def _computes(self, op) -> bool:
        return True

    def run_iteration(self, program: Program, iteration: int) -> IterationResult:
        res, t_iter, total = IterationResult(iteration), time.perf_counter(), self.ctx.job.dp * self.ctx.job.num_microbatches
        self._tensors()
        for k, op in enumerate(program.ops):
            self.ctx.step(iteration, k)
            if isinstance(op, Forward) and self._computes(op):
                t0 = time.perf_counter()
                x, y = self._batch(iteration, op.owner, op.mb)
                loss = ((x @ self.weight.T - y) ** 2).mean() / total
                loss.backward()
                res.loss += float(loss)
                res.forward_s[(op.owner, op.mb)] = self.ctx.faults.stretch(time.perf_counter() - t0)
                res.computed.append((0, op.owner, op.mb))
            elif isinstance(op, ReduceGrads):
                if self.weight.grad is None:
                    self.weight.grad = torch.zeros_like(self.weight)
                self.ctx.faults.delay_comm()
                dist.all_reduce(self.weight.grad, group=self.group)
            elif isinstance(op, OptimizerStep):
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
        res.iteration_s = time.perf_counter() - t_iter
        return res

    def snapshot(self):
        self._tensors()
        self._saved = (self.weight.detach().clone(), copy.deepcopy(self.opt.state_dict()))

    def rollback(self):
        if self._saved is not None:
            with torch.no_grad():
                self.weight.copy_(self._saved[0])
            self.opt.load_state_dict(copy.deepcopy(self._saved[1]))
            self.weight.grad = None

    def held_state(self):
        return {name: Shard(tuple(t.detach().clone() for t in ts)) for name, *ts in self._tensors()}

    def save_checkpoint(self, iteration):
        # The core owns the layout (docs/checkpoints.md): our file goes inside the
        # iteration's folder; the one writer seals it (manifest with SHA-256s) and
        # applies retention, so the supervisor can find and verify it.
        if self.ctx.device != min(self.plan.devices()):
            return
        job = self.ctx.job
        folder = checkpoints.iteration_dir(job.checkpoint_dir, iteration)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "example.pt"
        torch.save({"weight": self.weight.detach(), "opt": self.opt.state_dict()}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # a reader never sees half a file
        checkpoints.seal(job.checkpoint_dir, iteration)
        checkpoints.prune(job.checkpoint_dir, job.checkpoint_keep)

    def load_checkpoint(self, iteration, plan):
        ck = torch.load(checkpoints.iteration_dir(self.ctx.job.checkpoint_dir, iteration) / "example.pt")
        with torch.no_grad():
            self.weight.copy_(ck["weight"])
        self.opt.load_state_dict(ck["opt"])
        self.plan = plan
