"""The DeepSpeed user's GPT pipeline that ``overhead.py`` times (issue 35): token
embedding and LM head as one tied group (``TiedLayerSpec``), causal transformer blocks
from ``torch.nn`` with dropout (``seed_layers``), gradient clipping in the JSON, a torch
``AdamW``, and DeepSpeed's own data loader (``RepeatingLoader(engine.deepspeed_io(...))``).

One script, two launches, the same model, data, seed, layout and optimizer:

    resihp launch --config_file accelerate.yaml ds_gpt_train.py --out DIR ...        # ResiHP's adapter
    torchrun --nproc-per-node 4 ds_gpt_train.py --stock --config ds_config.json --out DIR ...

``--stock`` builds DeepSpeed's ``PipelineModule`` and calls ``deepspeed.initialize``
itself (no ResiHP code in the training path); without it the script calls
``resihp_adapters.deepspeed.initialize``, which ``resihp launch`` runs resiliently.
The stock side's global rank 0 appends ``iteration time samples`` to ``DIR/commits.txt``
after each step (DeepSpeed's ``train_batch`` returns once the pipeline's last stage has
its loss, after every stage's optimizer step) and ``iteration loss`` to ``DIR/losses.txt``
(DeepSpeed's global mean loss, which ``resihp launch`` prints per committed iteration);
with ``--save-dir`` it then writes DeepSpeed's own checkpoint (``engine.save_checkpoint``)
every iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.utils import RepeatingLoader
from torch import nn

#: tokens per sample (``micro_batch_size`` samples make a micro-batch)
SEQ = 16


class Embed(nn.Module):
    """Token embedding; as the LM head (:func:`head`) the same weight gives the logits."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


def head(module: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight.t()


class Block(nn.TransformerEncoderLayer):
    """A pre-norm causal transformer block."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__(hidden, nhead=heads, dim_feedforward=ffn, dropout=0.1, batch_first=True, norm_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return super().forward(x, src_mask=mask, is_causal=True)


class Tokens(torch.utils.data.Dataset):
    """Sample i is always the same ``SEQ + 1`` tokens (inputs and next-token labels)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return 1 << 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(self.vocab, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
        return ids[:-1], ids[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stock", action="store_true", help="plain DeepSpeed under torchrun (no ResiHP)")
    ap.add_argument("--config", help="the DeepSpeed JSON (--stock; resihp launch passes accelerate's)")
    ap.add_argument("--out", required=True, help="folder for commits.txt (--stock)")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=10, help="--stock: steps to train")
    ap.add_argument("--save-dir", help="--stock: engine.save_checkpoint here after every step")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(7)
    vocab, hidden = a.vocab, a.hidden
    layers = [TiedLayerSpec("embed", Embed, vocab, hidden),
              *(LayerSpec(Block, hidden, a.heads, a.ffn) for _ in range(a.blocks)),
              TiedLayerSpec("embed", Embed, vocab, hidden, forward_fn=head)]

    def xent(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

    def adamw(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)  # type: ignore[arg-type]

    data = Tokens(vocab)
    if a.stock:
        engine = _stock_engine(layers, xent, adamw, a.config)
    else:
        from resihp_adapters.deepspeed import initialize

        engine = initialize(layers, loss_fn=xent, optimizer=adamw, training_data=data, base_seed=11,
                            seed_layers=True, partition_method="uniform")
    batches = RepeatingLoader(engine.deepspeed_io(data))  # the user's own loader (a shuffling sampler)
    rank = int(os.environ.get("RANK", "0"))
    log = open(os.path.join(a.out, "commits.txt"), "a") if a.stock and rank == 0 else None
    samples = int(engine.train_batch_size()) if a.stock else 0
    it = 0
    while not a.stock or it < a.iterations:
        loss = engine.train_batch(batches)
        if loss is None:  # the job ended (resihp launch decides how many iterations)
            break
        if log is not None:
            log.write(f"{it} {time.time():.6f} {samples}\n")
            log.flush()
            with open(os.path.join(a.out, "losses.txt"), "a") as f:  # the global mean loss, as resihp launch prints it
                f.write(f"{it} {float(loss):.10f}\n")
        it += 1
        if a.save_dir:
            engine.save_checkpoint(a.save_dir)
    if a.stock:
        _close()


def _stock_engine(layers: list, loss_fn: object, optimizer: object, config: str | None):  # noqa: ANN202
    """Plain DeepSpeed: ``PipelineModule`` of the same layers (same seeds, DeepSpeed's
    uniform split over 2 stages) and ``deepspeed.initialize``, as a DeepSpeed user
    writes it, with the ResiHP side's per-layer seeding function (below)."""
    import importlib

    import deepspeed
    from deepspeed.pipe import PipelineModule

    if not config:
        raise SystemExit("--stock needs --config (the DeepSpeed JSON)")
    with open(config) as f:
        cfg = json.load(f)
    cfg.pop("resihp", None)
    # Start-up only: DeepSpeed would JIT-compile its shared-memory all-reduce op, which
    # serves inference (the training path's collectives are torch.distributed's).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    # The same per-layer seeding function as the ResiHP side: the same generator states
    # as DeepSpeed's own, without the stacks torch formats on a host without a GPU (a
    # GPU host, once CUDA runs, formats none either); overhead.py credits neither side.
    from resihp_adapters.deepspeed.engine import seed_layer

    module = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, seed_layers=True, base_seed=11,
                            partition_method="uniform", seed_fn=seed_layer)
    opt = optimizer([p for p in module.parameters() if p.requires_grad])  # type: ignore[operator]
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    return engine


def _close() -> None:
    """Destroy the groups while the interpreter is whole (a gloo thread left to
    interpreter shutdown can abort a finished rank: docs/deepspeed.md, "Exit")."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
