"""CPU per iteration of the torch_native engine against peers.py's plain DDP step, in
one process (world of 1, gloo, the peers' dp4 model and data, float64): the in-process
part of the fault-free gap, without agents, the controller, the commit protocol or
other workers competing for the 2 cores (docs/benchmarks.md, "Session 11").

The engine's iteration is what a ResiHP worker runs per iteration (the rollback
snapshot, then ``run``: the pipeline runtime, FSDP2, the optimizer step); the DDP step
is peers.py's plain script. Their difference reproduces the dp4 workers' per-worker CPU
gap of ``reconfigure.py --fault-free-job dp4`` in one process. Run it with another
checkout first on PYTHONPATH for an A/B of engine changes at the same load.

``--size`` takes overhead.py's model sizes (default ``xs``, the peers' dp4 model). Each
round also splits the engine's iteration into parts (rollback snapshot, forward,
backward, the gradient reduction: FSDP's post-backward and, on this unsharded stage,
the replica buckets' copy-in (inside the backward) and wait; optimizer step, and the
SDC fingerprint the adapter computes after it for HSDP replicas), each with its CPU
milliseconds and the minor page faults it took: on the host, memory allocated afresh
every iteration shows up as page faults (docs/benchmarks.md, "Where a fault-free
iteration goes").

Usage: python benchmarks/engine_cpu.py [--size xs|s|m|l] [--iterations N] [--rounds R] [--threads T] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="xs", help="overhead.py's model size: xs, s, m or l (default xs)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's intra-op threads (0: torch's default; ResiHP's workers run 1)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from overhead import SIZES

    if args.size not in SIZES:
        ap.error(f"--size: unknown {args.size!r} (known: {', '.join(SIZES)})")
    size = SIZES[args.size]

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import resihp_adapters
    from resihp_core.job import JobSpec
    from resihp_core.plan import ParallelPlan
    from resihp_core.predictor.schedules import emit_programs
    from resihp_adapters.torch_native.data import Batches, job_source
    from resihp_adapters.torch_native.engine import TorchNativeEngine
    from resihp_adapters.torch_native.model import LlamaConfig, build_stage, loss_sum

    torch.set_num_threads(1)
    m = 3  # the dp4 job's micro-batches per replica (peers.JOBS["dp4"])
    cfg = LlamaConfig(vocab_size=size["vocab"], dim=size["hidden"], n_layers=size["layers"], n_heads=size["heads"],
                      ffn_dim=size["ffn_hidden"], dtype="float64")
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 64},
                  dp=1, num_microbatches=m)
    data = Batches(job_source(job, 256), torch.float64)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    eng = TorchNativeEngine(0, cfg, data, dist.HashStore(), shard_degree=1, lr=0.01, weight_decay=0.0)
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=4, num_microbatches=m)
    eng.rebuild(plan, 0, [0])
    eng.start_fresh()
    eng.keep_snapshots(2)  # as the worker's overlapped commit keeps them
    prog = {(p.replica, p.stage): p for p in emit_programs(plan)}[(0, 0)]
    model = build_stage(cfg, 0, cfg.n_layers)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0, foreach=False)
    it = [0]

    def engine() -> None:
        eng.snapshot()
        eng.run(prog, it[0])
        it[0] += 1

    def plain() -> None:  # peers.py's plain DDP step
        i = it[0]
        it[0] += 1
        denom = float(sum(data.micro_batch(i, 0, j, m).labels.ne(-100).sum() for j in range(m)))
        for j in range(m):
            mb = data.micro_batch(i, 0, j, m)
            with ddp.no_sync() if j < m - 1 else contextlib.nullcontext():
                (loss_sum(ddp(mb.tokens, **mb.kwargs()), mb.labels) / denom).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def cpu_ms(fn) -> float:
        for _ in range(3):
            fn()
        t0 = time.process_time()
        for _ in range(args.iterations):
            fn()
        return 1e3 * (time.process_time() - t0) / args.iterations

    parts: dict[str, list[float]] = {}

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def timed(label: str, fn):
        def run(*a, **k):
            f0, t0 = faults(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                book = parts.setdefault(label, [0.0, 0.0])
                book[0] += 1e3 * (time.process_time() - t0)
                book[1] += faults() - f0
        return run

    def digest_views() -> tuple[list[str], list]:  # what the adapter reads for HSDP replicas (adapter.fingerprint)
        from torch.distributed.tensor import DTensor

        from resihp_core.detector.sdc import digest_windows, windows

        local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
        params, state = [], []
        for name, p in eng.module.named_parameters():
            params.append((name, local(p)))
            st = eng.optimizer.state.get(p, {})
            state += [(f"{k}.{name}", local(st[k])) for k in sorted(st) if isinstance(st[k], torch.Tensor)]
        share, rounds = windows()
        return digest_windows(params, share=share, turn=eng.iteration, state=state, rounds=rounds)

    def fingerprint() -> None:  # a separate pass (as without the worker's overlapped commit)
        from resihp_core.detector.sdc import seal, window_sum

        labels, views = digest_views()
        with torch.no_grad():
            seal(labels, [window_sum(v) for v in views])

    def fused() -> None:  # the next iteration's snapshot, the fingerprint read during its copy
        from resihp_core.detector.sdc import seal

        labels, views = digest_views()
        seal(labels, eng.snapshot(views))

    def split_ms() -> dict[str, list[float]]:
        """The engine's iteration by part: CPU ms and page faults per iteration."""
        parts.clear()
        n = max(3, args.iterations // 4)
        for _ in range(n):
            timed("snapshot", eng.snapshot)()
            eng.run(prog, it[0])
            it[0] += 1
            timed("fingerprint (HSDP replicas), a separate pass", fingerprint)()
        got = {k: [v[0] / n, v[1] / n] for k, v in parts.items()}
        # The worker's overlapped commit: the next iteration's snapshot right after the
        # step, the fingerprint read during its copy (docs/sdc.md "What it costs").
        label = "snapshot with the fingerprint read during its copy"
        eng.snapshot()
        for _ in range(n):
            eng.run(prog, it[0])
            it[0] += 1
            timed(label, fused)()
        got[label] = [v / n for v in parts[label]]
        return got

    st = eng.stage
    st.forward_one_chunk = timed("forward", st.forward_one_chunk)
    st.backward_one_chunk = timed("backward", st.backward_one_chunk)
    st.perform_reduce_grad = timed("gradient reduction: FSDP's post-backward", st.perform_reduce_grad)
    red = getattr(eng, "_reducer", None)
    if red is not None:  # a pure replica's buckets (.replica_reduce): copy-in inside the backward, then the wait
        red._copy = timed("gradient reduction: bucket copy-in (inside backward)", red._copy)
        red.finish = timed("gradient reduction: bucket wait and gradients set", red.finish)
    group = eng.module._get_fsdp_state()._fsdp_param_group
    if group is not None:  # FSDP's own work on the stage, also inside forward and backward
        group.wait_for_unshard = timed("FSDP unshard: unsharded parameters set (inside forward)",
                                       group.wait_for_unshard)
        group.reshard = timed("FSDP reshard (inside backward)", group.reshard)
    eng.step_optimizer = timed("optimizer step", eng.step_optimizer)
    rounds = []
    for r in range(args.rounds):
        a, b = cpu_ms(engine), cpu_ms(plain)
        rounds.append({"engine_ms": a, "ddp_ms": b, "load": os.getloadavg()[0], "parts": split_ms()})
        print(f"round {r + 1}: engine {a:.2f} ms CPU/it, plain DDP {b:.2f}, difference {a - b:+.2f}; "
              f"load {os.getloadavg()[0]:.1f}")
    med = {k: statistics.median(x[k] for x in rounds) for k in ("engine_ms", "ddp_ms")}
    names = list(rounds[0]["parts"])
    split = {k: [statistics.median(x["parts"][k][i] for x in rounds) for i in (0, 1)] for k in names}
    print(f"median: engine {med['engine_ms']:.2f}, plain DDP {med['ddp_ms']:.2f} ms CPU/it "
          f"({os.path.dirname(resihp_adapters.__file__)}; size {args.size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    print("| part of the engine's iteration | CPU ms | page faults |\n| --- | --- | --- |")
    for k, (ms, fl) in split.items():
        print(f"| {k} | {ms:.1f} | {fl:.0f} |")
    eng.release()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "threads": torch.get_num_threads(), "rounds": rounds, "median": med, "parts_median": split,
                       "tree": os.path.dirname(resihp_adapters.__file__)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
