"""The initial stage split of a job: the one DeepSpeed's ``PipelineModule`` itself makes
for the user's ``partition_method`` ("uniform", "parameters", "type:<regex>").

The split is computed by DeepSpeed's own ``PipelineModule._partition_layers`` (which
counts parameters by building each layer spec, or matches layer type names, and cuts
with ``partition_balanced`` / ``partition_uniform``) on a module that holds only the
layer specs: nothing is re-implemented, so an unchanged script trains the same model
under ``resihp launch`` as under plain DeepSpeed (``docs/deepspeed.md``,
``partition_method``).

Under ``resihp launch`` the launcher plans the first generation before any worker runs
the script, so for a method other than "uniform" it first runs the script as a *probe*
(:data:`PROBE_ENV` names a file): ``initialize`` writes DeepSpeed's split there and
the process exits before training.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

__all__ = ["PROBE_ENV", "PROBE_STAGES_ENV", "deepspeed_parts", "check_partition_method", "parts_to_ranges",
           "write_probe", "read_probe",
           "stock_module_class"]

#: Set by the launcher for the probe run: the file ``initialize`` writes the split to.
PROBE_ENV = "RESIHP_PARTITION_PROBE"
#: The probe's number of pipeline stages (the launch's ``resihp.pp``).
PROBE_STAGES_ENV = "RESIHP_PARTITION_PROBE_STAGES"


def check_partition_method(method: object) -> str:
    """The method as DeepSpeed spells it (lower case); refuse, with the reason, one
    DeepSpeed would refuse too ("profile" is not implemented there)."""
    if not isinstance(method, str):
        raise ValueError(f"partition_method must be a string ('uniform', 'parameters' or 'type:<regex>'), "
                         f"got {method!r}")
    m = method.lower()
    if m in ("uniform", "parameters") or (m.startswith("type:") and len(m) > len("type:")):
        return m
    raise ValueError(f"partition_method={method!r}: DeepSpeed's PipelineModule implements 'uniform', 'parameters' "
                     "and 'type:<regex>' only")


def deepspeed_parts(layers: Sequence[Any], num_stages: int, method: str = "uniform") -> list[int]:
    """Stage boundaries (``num_stages + 1`` layer indices) DeepSpeed's ``PipelineModule``
    computes for ``layers`` and ``method``. Layers built to count parameters are built
    under a forked RNG, so the caller's random state is unchanged."""
    import torch
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    method = check_partition_method(method)
    if num_stages < 1 or num_stages > len(layers):
        raise ValueError(f"cannot split {len(layers)} layers into {num_stages} pipeline stages")
    # DeepSpeed's partitioning reads only these fields of the module; rank 1 of a
    # two-replica grid is stage 0 and prints nothing (rank 0 prints the split).
    module = PipelineModule.__new__(PipelineModule)
    torch.nn.Module.__init__(module)
    module._layer_specs = list(layers)
    module.num_stages = int(num_stages)
    module._topo = PipeDataParallelTopology(num_pp=int(num_stages), num_dp=2)
    module.global_rank = 1
    module.loss_fn = None
    with torch.random.fork_rng(devices=[]):
        module._partition_layers(method=method)
    return [int(p) for p in module.parts]


def parts_to_ranges(parts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """DeepSpeed's boundaries as a plan's ``layer_ranges``; a stage with no layers (which
    DeepSpeed allows and ResiHP's plans do not) is refused with the reason."""
    ranges = tuple((int(a), int(b)) for a, b in zip(parts[:-1], parts[1:]))
    empty = [s for s, (a, b) in enumerate(ranges) if b <= a]
    if empty:
        raise ValueError(f"DeepSpeed's split {list(parts)} leaves pipeline stage(s) {empty} without layers; "
                         "ResiHP plans give every stage at least one layer (use fewer stages or another "
                         "partition_method)")
    return ranges


def write_probe(path: str, layers: Sequence[Any], method: str) -> None:
    """The probe's answer: DeepSpeed's split for the launch's stage count, as JSON."""
    stages = int(os.environ.get(PROBE_STAGES_ENV, "2"))
    parts = deepspeed_parts(layers, stages, method)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"method": check_partition_method(method), "stages": stages, "num_layers": len(layers),
                   "parts": parts}, f)
    os.replace(tmp, path)


def read_probe(path: str) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("parts"), list):
        raise ValueError(f"{path}: not a partition probe answer")
    return data


def stock_module_class() -> type:
    """DeepSpeed's ``PipelineModule`` for a plain-DeepSpeed launch, its split (DeepSpeed's
    own) made of Python ints: ``partition_balanced`` ("parameters", "type:") returns numpy
    integers, and with ``seed_layers`` DeepSpeed then calls ``random.seed(base_seed +
    layer index)`` with one, which Python 3.11 refuses (``TypeError``, DeepSpeed 0.19.8):
    plain DeepSpeed cannot build such a module at all (``docs/deepspeed.md``)."""
    from deepspeed.pipe import PipelineModule

    class IntSplitPipelineModule(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            super()._partition_layers(method=method)
            self.parts = [int(p) for p in self.parts]
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return IntSplitPipelineModule
