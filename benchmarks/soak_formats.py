"""How the soak (benchmarks/soak.py) reads each adapter's checkpoints and takes fault-free
reference steps from them, in the soak's own process (docs/checkpoints.md, "Soak").

Every format gives the same thing: :data:`State`, by parameter name, the parameter and
its AdamW moments (and, where the checkpoint stores it, AdamW's step count), so one
comparison serves all adapters. Each adapter is read in the format it writes inside the
core's ``iter<N>/`` folder:

- ``megatron_ref``: its ``components`` (``torchkit.checkpoint.load_component``), steps by
  the adapter's own single-process reference (``megatron_ref.reference``);
- ``torch_native``: the ``dcp/`` folder, read with ``torch.distributed.checkpoint`` in
  one process into the whole model's state dicts (the same ``get_*_state_dict`` layout
  the engine saves, so FSDP shards of any plan come back whole); steps by the same loop
  as the adapter's ``reference.single_process_run``, started from that state;
- ``deepspeed``: the ``layers/layer_<NNNN>-tp0.pt`` files (per-layer parameters and
  optimizer state as ``deepspeed.state.extract_layers`` writes them); steps by the toy
  model (``deepspeed.toy``) in one process with DeepSpeed's accounting (each replica
  accumulates ``loss / micro-batches``, then the data-parallel average).

Completeness is the core's rule for every format (``resihp_core.checkpoints.verify``:
the manifest, every file it names, their SHA-256s), so a corrupt checkpoint is bridged
like an incomplete one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol

import torch

from resihp_core import checkpoints
from resihp_core.job import JobSpec

#: parameter name -> (param, exp_avg, exp_avg_sq[, step])
State = dict[str, tuple[torch.Tensor, ...]]
#: what a reference step yields: (iteration, loss, state after it)
Step = tuple[int, float, State]

FIELDS = ("param", "exp_avg", "exp_avg_sq", "step")


class CheckpointUnreadable(Exception):
    """A checkpoint's files could not be read (a newer generation may be rewriting it)."""


class Format(Protocol):
    """One adapter's checkpoints, read and stepped in the soak's process."""

    def complete(self, root: Path, it: int) -> bool: ...

    def load(self, root: Path, it: int) -> State: ...

    def steps(self, state: State | None, start: int, stop: int) -> Iterator[Step]:
        """Reference steps ``start .. stop - 1`` from ``state`` (None: the seeded initial
        weights, before iteration 0)."""
        ...


def _adamw_state(opt: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]],
                 prefix: str = "") -> State:
    out: State = {}
    for name, p in named:
        st = opt.state.get(p, {})
        zero = torch.zeros_like(p)
        out[prefix + name] = (p.detach().clone(), st.get("exp_avg", zero).clone(), st.get("exp_avg_sq", zero).clone(),
                              torch.as_tensor(st.get("step", 0.0), dtype=torch.float64).clone())
    return out


def _install(opt: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]], state: State,
             prefix: str = "") -> None:
    """Put ``state`` (every parameter and its AdamW state) into the model and ``opt``."""
    with torch.no_grad():
        for name, p in named:
            param, m, v, step = state[prefix + name]
            p.copy_(param)
            opt.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": m.clone().to(p.dtype),
                            "exp_avg_sq": v.clone().to(p.dtype)}


# ---------------------------------------------------------------------------- megatron_ref
class _Complete:
    """Complete by the core's rule (manifest, every file it names, SHA-256s)."""

    def complete(self, root: Path, it: int) -> bool:
        return checkpoints.verify(root, it).complete


class MegatronRef(_Complete):
    """megatron_ref's component files; steps by its own reference."""

    def __init__(self, spec: JobSpec) -> None:
        from resihp_adapters.megatron_ref.adapter import data_spec, model_config

        self.model, self.data = model_config(spec), data_spec(spec)
        self.lr = float(spec.adapter_config["lr"])

    def load(self, root: Path, it: int) -> State:
        from resihp_adapters.torchkit.checkpoint import CheckpointError, load_component

        out: State = {}
        try:
            for c in ["embed", *(f"layers.{i}" for i in range(self.model.num_layers)), "head"]:
                out.update({name: tuple(ts) for name, ts in load_component(root, it, c).items()})
        except (CheckpointError, OSError) as e:
            raise CheckpointUnreadable(str(e)) from e
        return out

    def steps(self, state: State | None, start: int, stop: int) -> Iterator[Step]:
        from resihp_adapters.megatron_ref.reference import reference_trajectory

        for j, loss, st in reference_trajectory(self.model, self.data, stop, lr=self.lr, start=start, state=state):
            yield j, loss, {k: tuple(v) for k, v in st.items()}


# ---------------------------------------------------------------------------- torch_native
class TorchNative(_Complete):
    """torch_native's DCP folder, read whole in one process; the adapter's reference loop."""

    def __init__(self, spec: JobSpec) -> None:
        from resihp_adapters.torch_native.adapter import parse_config
        from resihp_adapters.torch_native.data import Batches, job_source

        c = parse_config(spec.adapter_config, spec.seed)
        self.cfg, self.lr, self.wd = c["model"], c["lr"], c["weight_decay"]
        self.data = Batches(job_source(spec, self.cfg.vocab_size), self.cfg.torch_dtype)

    def _model(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from resihp_adapters.torch_native.model import build_stage

        model = build_stage(self.cfg, 0, self.cfg.n_layers)
        opt = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.wd, foreach=False)
        return model, opt

    def load(self, root: Path, it: int) -> State:
        """The engine's own state-dict layout (model + flattened optimizer), filled by
        ``dcp.load`` from the checkpoint without a process group."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        from resihp_adapters.torch_native.engine import read_checkpoint

        model, opt = self._model()
        named = list(model.named_parameters())
        _install(opt, named, {n: (p.detach(), torch.zeros_like(p), torch.zeros_like(p), torch.tensor(0.0))
                              for n, p in named})
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        sd = {"model": get_model_state_dict(model, options=opts),
              "optim": get_optimizer_state_dict(model, opt, options=opts)}
        path = checkpoints.iteration_dir(root, it) / "dcp"
        try:
            sd = read_checkpoint(sd, str(path), alone=True)
        except Exception as e:  # noqa: BLE001 - DCP wraps storage errors in its own exceptions
            raise CheckpointUnreadable(f"{path}: {type(e).__name__}: {e}") from e
        m, o = sd["model"], sd["optim"]
        return {n: (m[n].clone(), o[f"state.{n}.exp_avg"].clone(), o[f"state.{n}.exp_avg_sq"].clone(),
                    torch.as_tensor(o[f"state.{n}.step"], dtype=torch.float64).clone()) for n, _ in named}

    def steps(self, state: State | None, start: int, stop: int) -> Iterator[Step]:
        from resihp_adapters.torch_native.model import loss_sum

        model, opt = self._model()
        named = list(model.named_parameters())
        if state is not None:
            _install(opt, named, state)
        g_all = self.data.global_microbatches
        for it in range(start, stop):
            denom = float(self.data.label_count(it))
            total = 0.0
            for g in range(g_all):
                mb = self.data.micro_batch(it, 0, g, g_all)
                loss = loss_sum(model(mb.tokens, **mb.kwargs()), mb.labels) / denom
                loss.backward()
                total += float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            yield it, total, _adamw_state(opt, named)


# ---------------------------------------------------------------------------- deepspeed
class DeepSpeedToy(_Complete):
    """DeepSpeed's per-layer files; the toy model (``deepspeed.toy``) stepped in one process."""

    def __init__(self, spec: JobSpec) -> None:
        from resihp_adapters.deepspeed.data import MicroBatchSource
        from resihp_adapters.deepspeed.toy import Samples

        a = spec.adapter_config
        if a.get("model") != "resihp_adapters.deepspeed.toy:build":
            raise ValueError("the soak's DeepSpeed reference is the toy model (resihp_adapters.deepspeed.toy:build)")
        self.hidden, self.layers = int(a.get("hidden", 64)), int(a.get("num_layers", 6))
        self.mbs, self.lr, self.seed = int(a.get("micro_batch_size", 2)), float(a.get("lr", 1e-3)), int(a.get("seed", 7))
        self.m, self.dp = spec.num_microbatches, spec.dp
        self.src = MicroBatchSource(Samples(4096, self.hidden), MicroBatchSource.default_collate, self.mbs, self.m,
                                    self.dp)

    def _model(self) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
        from resihp_adapters.deepspeed.toy import Block

        blocks, default = [], torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # as the toy's build() does before DeepSpeed builds the layers
        try:
            for idx in range(self.layers):  # DeepSpeed's seed_layers: base_seed + layer index
                torch.manual_seed(self.seed + idx)
                blocks.append(Block(self.hidden))
        finally:
            torch.set_default_dtype(default)
        model = torch.nn.Sequential(*blocks)
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr)  # the toy's optimizer

    def _batch(self, it: int, r: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The toy's samples are drawn in the default dtype, which its build() sets to float64."""
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return self.src.micro_batch(it, r, j)
        finally:
            torch.set_default_dtype(default)

    def load(self, root: Path, it: int) -> State:
        d = checkpoints.iteration_dir(root, it) / "layers"
        out: State = {}
        try:
            for idx in range(self.layers):
                st = torch.load(d / f"layer_{idx:04d}-tp0.pt", weights_only=True)
                for name, p in st["params"].items():
                    o = st["opt"].get(name, {})
                    zero = torch.zeros_like(p)
                    out[f"{idx}.{name}"] = (p, o.get("exp_avg", zero), o.get("exp_avg_sq", zero),
                                            torch.as_tensor(o.get("step", 0.0), dtype=torch.float64))
        except (OSError, RuntimeError, KeyError, EOFError) as e:
            raise CheckpointUnreadable(f"{d}: {type(e).__name__}: {e}") from e
        return out

    def steps(self, state: State | None, start: int, stop: int) -> Iterator[Step]:
        from resihp_adapters.deepspeed.toy import mse

        model, opt = self._model()
        named = [(f"{i}.{n}", p) for i, b in enumerate(model) for n, p in b.named_parameters()]
        if state is not None:
            _install(opt, named, state)
        for it in range(start, stop):
            total = 0.0
            for r in range(self.dp):
                for j in range(self.m):
                    x, y = self._batch(it, r, j)
                    loss = mse(model(x), y)
                    (loss / (self.m * self.dp)).backward()
                    total += float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            yield it, total / (self.m * self.dp), _adamw_state(opt, named)


FORMATS: dict[str, type] = {"megatron_ref": MegatronRef, "torch_native": TorchNative, "deepspeed": DeepSpeedToy}


def format_for(spec: JobSpec) -> Format:
    """The soak's reader and reference for ``spec``'s adapter."""
    try:
        return FORMATS[spec.adapter](spec)
    except KeyError:
        raise ValueError(f"the soak has no checkpoint reader for adapter {spec.adapter!r} "
                         f"(known: {sorted(FORMATS)})") from None
