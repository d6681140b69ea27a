"""``python -m resihp_core.runtime.worker``: the worker process."""

import sys

from resihp_core.runtime.worker import main

sys.exit(main())
