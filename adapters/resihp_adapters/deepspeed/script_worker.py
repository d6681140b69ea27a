"""The worker module DeepSpeed's ``resihp launch`` starts: the shared launch worker
(:mod:`resihp_adapters.launch_worker`), kept under this name for existing launches."""

from __future__ import annotations

from resihp_adapters.launch_worker import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
