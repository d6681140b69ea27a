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

import torch
import torch.distributed as dist

from resihp_adapters.megatron_core.build import build_training, samples_of, transformer_config
from resihp_adapters.megatron_core.spec import check_supported, load_job

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=2, help="per replica")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--user", default="", help="module:function returning a MegatronJob")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="the built-in job's dtype")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from resihp_adapters.megatron_core import cpu

        cpu.enable()
    job = load_job({"user": args.user} if args.user else {"dtype": args.dtype})
    check_supported(job, cuda=cuda)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    config = transformer_config(job, tp=args.tp, pp=args.pp, layer_ranges=None, cuda=cuda)
    tr = build_training(job, config, seed=args.seed, device=torch.device("cuda") if cuda else None)
    m, G = args.microbatches, args.microbatches * dp
    losses: list[float] = []

    def forward_step(data_iterator, model):
        output, loss_func = job.forward_step(data_iterator, model)

        def record(out):
            got = loss_func(out)
            if len(got) == 3:
                losses.append(float(got[0].detach()) / max(float(got[1]), 1.0))
            else:
                losses.append(float(got[0].detach()))
            return got

        return output, record

    for i in range(args.iterations):
        losses.clear()
        tr.ddp.zero_grad_buffer()
        tr.optimizer.zero_grad()
        data = iter([samples_of(job, i, r * m + j, G) for j in range(m)])
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=[tr.ddp],
                                    num_microbatches=m, seq_length=job.seq_length,
                                    micro_batch_size=job.micro_batch_size, forward_only=False)
        tr.optimizer.step()
        if tr.scheduler is not None:
            tr.scheduler.step(increment=G * job.micro_batch_size)
        if ps.is_pipeline_last_stage():
            total = torch.tensor([sum(losses)], dtype=torch.float64, device="cuda" if cuda else "cpu")
            dist.all_reduce(total, group=ps.get_data_parallel_group())
            if r == 0 and ps.get_tensor_model_parallel_rank() == 0:
                print(json.dumps({"iteration": i, "loss": float(total) / G}), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
