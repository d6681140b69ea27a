"""The worker module DeepSpeed's ``resihp launch`` starts (the shared launch worker,
:mod:`resihp_adapters.launch_worker`), and the partition probe's entry point
(``--probe SCRIPT ARGS...``: the script run up to ``initialize``, :mod:`.partition`).

Either way the script's own ``deepspeed.init_distributed()`` is deferred first: under
``resihp launch`` the process groups are ResiHP's, built by ``initialize`` for each
plan generation. DeepSpeed's call would otherwise join a world of every launched rank
over ``MASTER_ADDR:MASTER_PORT`` (which a worker started later, or the probe running
alone, would wait for forever; the probe, without those variables, makes DeepSpeed look
for MPI: ``ModuleNotFoundError: mpi4py``)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import runpy
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

from resihp_adapters.launch_worker import main as launch_main

__all__ = ["main", "defer_init_distributed"]

_TARGET = "deepspeed.comm.comm"


def _deferring(original: Callable[..., Any]) -> Callable[..., Any]:
    said = []

    def init_distributed(*args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's ``init_distributed`` once a world exists (ResiHP's own call inside
        ``initialize``); before that, the user's call returns at once."""
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            return original(*args, **kwargs)
        if not said:
            said.append(True)
            print("resihp: deepspeed.init_distributed() deferred: under resihp launch initialize() builds the "
                  "process groups of each plan generation (docs/deepspeed.md)", flush=True)
        return None

    init_distributed.__wrapped__ = original  # type: ignore[attr-defined]
    return init_distributed


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        module.init_distributed = _deferring(module.init_distributed)  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps ``deepspeed.comm.comm``'s ``init_distributed`` as the module loads, before
    ``deepspeed/__init__.py`` binds it as ``deepspeed.init_distributed`` (DeepSpeed is
    not imported early: its accelerator is chosen at import, after the adapter's
    settings)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def defer_init_distributed() -> None:
    """Install the deferral (idempotent; see the module docstring)."""
    if _TARGET in sys.modules:
        mod = sys.modules[_TARGET]
        if not hasattr(mod.init_distributed, "__wrapped__"):
            mod.init_distributed = _deferring(mod.init_distributed)
            if "deepspeed" in sys.modules:
                sys.modules["deepspeed"].init_distributed = mod.init_distributed
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def main() -> None:
    defer_init_distributed()
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        script = sys.argv[2]
        sys.argv = [script, *sys.argv[3:]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
        return
    launch_main()


if __name__ == "__main__":
    main()
