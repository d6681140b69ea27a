"""torch-native adapter: torch.distributed.pipelining stages, FSDP2 data parallelism.

Importing this package imports no torch; :func:`initialize` does. See
``docs/torch_native.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["initialize"]


def initialize(*args: Any, **kwargs: Any) -> Any:
    """See :func:`resihp_adapters.torch_native.api.initialize`."""
    from resihp_adapters.torch_native.api import initialize as _initialize

    return _initialize(*args, **kwargs)
