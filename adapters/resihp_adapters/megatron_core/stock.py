"""The same job, stock: plain Megatron-Core under ``torchrun``, no ResiHP.

``python -m torch.distributed.run --nproc-per-node N -m resihp_adapters.megatron_core.stock
--tp T --pp P --microbatches M --iterations I [--user module:function | --dtype D]`` trains the job
(the built-in GPT job, or the user's :class:`~.spec.MegatronJob`) with ``pretrain_gpt``'s
loop: Megatron's 1F1B over the replica's micro-batches, the Megatron optimizer, the
scheduler stepped by the global batch. It prints one JSON line per iteration with the
global mean loss (rank 0 of the last stage), which a ResiHP run of the same job must
reproduce step for step (``docs/megatron_core.md``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resihp_adapters.megatron_core.build import build_training, samples_of, transformer_config
from resihp_adapters.megatron_core.spec import MegatronJob, check_supported, load_job

__all__ = ["StockRun", "main"]


class StockRun:
    """``pretrain_gpt``'s loop for ``job`` in this torchrun process (``WORLD_SIZE`` =
    ``tp x pp x dp``): builds the groups and training objects; :meth:`train_batch` runs
    one iteration. ``microbatches`` per replica."""

    def __init__(self, job: MegatronJob, *, tp: int, pp: int, microbatches: int, seed: int) -> None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        else:
            from resihp_adapters.megatron_core import cpu

            cpu.enable()
        check_supported(job, cuda=self.cuda)
        dist.init_process_group("nccl" if self.cuda else "gloo", timeout=timedelta(seconds=120))
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self.job = job
        self.dp, self.r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        config = transformer_config(job, tp=tp, pp=pp, layer_ranges=None, cuda=self.cuda)
        self.tr = build_training(job, config, seed=seed, device=torch.device("cuda") if self.cuda else None)
        self.m, self.G = microbatches, microbatches * self.dp
        self.iteration = 0

    def train_batch(self) -> float:
        """One iteration; this rank's share of the global mean loss (the sum of its
        micro-batches' losses over the global micro-batch count: 0 off the last stage)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        job, tr, losses = self.job, self.tr, []

        def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            output, loss_func = job.forward_step(data_iterator, model)

            def record(out: torch.Tensor) -> tuple:
                got = loss_func(out)
                losses.append(float(got[0].detach()) / max(float(got[1]), 1.0) if len(got) == 3
                              else float(got[0].detach()))
                return got

            return output, record

        i = self.iteration
        tr.ddp.zero_grad_buffer()
        tr.optimizer.zero_grad()
        data = iter([samples_of(job, i, self.r * self.m + j, self.G) for j in range(self.m)])
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=[tr.ddp],
                                    num_microbatches=self.m, seq_length=job.seq_length,
                                    micro_batch_size=job.micro_batch_size, forward_only=False)
        tr.optimizer.step()
        if tr.scheduler is not None:
            tr.scheduler.step(increment=self.G * job.micro_batch_size)
        self.iteration += 1
        return sum(losses) / self.G

    def is_last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage()

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=2, help="per replica")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--user", default="", help="module:function returning a MegatronJob")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="the built-in job's dtype")
    ap.add_argument("--distributed-optimizer", action="store_true", help="the built-in job with Megatron's "
                    "distributed optimizer")
    args = ap.parse_args(argv)
    job = load_job({"user": args.user} if args.user else
                   {"dtype": args.dtype, "distributed_optimizer": args.distributed_optimizer})
    run = StockRun(job, tp=args.tp, pp=args.pp, microbatches=args.microbatches, seed=args.seed)
    from megatron.core import parallel_state as ps

    for i in range(args.iterations):
        share = run.train_batch()
        if run.is_last_stage():
            total = torch.tensor([share], dtype=torch.float64, device="cuda" if run.cuda else "cpu")
            dist.all_reduce(total, group=ps.get_data_parallel_group())
            if run.r == 0 and ps.get_tensor_model_parallel_rank() == 0:
                print(json.dumps({"iteration": i, "loss": float(total)}), flush=True)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
