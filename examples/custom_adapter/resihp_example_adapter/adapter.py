"""A dry-run adapter: it implements the contract by recording each request.

A real adapter would build torch.distributed groups in ``rebuild_communicators`` and
turn each primitive of the program into its framework's instruction in ``emit``.
"""

from __future__ import annotations

import time

from resihp_core.adapter import Adapter, Capabilities
from resihp_core.plan import ParallelPlan
from resihp_core.program import Backward, Forward, Program
from resihp_core.protocol import IterationProfile, MicroBatchProfile

from resihp_example_adapter.plugin import CAPABILITIES


class ExampleAdapter(Adapter):
    name = "example"
    capabilities: Capabilities = CAPABILITIES

    def __init__(self, rank: int = 0, device: int | None = None) -> None:
        self.rank = rank
        self.device = rank if device is None else device
        self.generation = 0
        self.iteration = 0
        self.log: list[str] = []
        self._last: IterationProfile | None = None

    def rebuild_communicators(self, plan: ParallelPlan, generation: int) -> None:
        self.generation = generation
        self.log.append(f"groups for generation {generation}: {plan.dp} replicas x {plan.pp} stages")

    def emit(self, program: Program) -> None:
        start = time.perf_counter()
        fwd: dict[tuple[int, int], float] = {}
        bwd: dict[tuple[int, int], float] = {}
        for op in program.ops:  # a real adapter issues the framework's instruction here
            t = time.perf_counter()
            self.log.append(type(op).__name__)
            if isinstance(op, Forward):
                fwd[(op.owner, op.mb)] = time.perf_counter() - t
            elif isinstance(op, Backward):
                bwd[(op.owner, op.mb)] = time.perf_counter() - t
        self._last = IterationProfile(
            rank=self.rank,
            device=self.device,
            generation=program.generation,
            iteration=self.iteration,
            stage=program.stage,
            replica=program.replica,
            microbatches=tuple(
                MicroBatchProfile(owner=o, mb=m, forward_s=f, backward_s=bwd.get((o, m), 0.0))
                for (o, m), f in fwd.items()
            ),
            comm_s=0.0,
            iteration_s=time.perf_counter() - start,
        )
        self.iteration += 1

    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan) -> None:
        self.log.append(f"move state: generation {old_plan.generation} -> {new_plan.generation}")

    def profile(self) -> IterationProfile | None:
        return self._last
