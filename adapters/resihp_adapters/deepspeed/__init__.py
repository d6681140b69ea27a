"""ResiHP for DeepSpeed pipeline jobs: ``initialize`` in place of ``deepspeed.initialize``.

Importing this package imports neither torch nor deepspeed; :func:`initialize` does.
See ``docs/deepspeed.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["initialize"]


def initialize(*args: Any, **kwargs: Any) -> Any:
    """See :func:`resihp_adapters.deepspeed.api.initialize`."""
    from resihp_adapters.deepspeed.api import initialize as _initialize

    return _initialize(*args, **kwargs)
