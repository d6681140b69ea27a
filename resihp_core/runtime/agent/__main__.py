"""``python -m resihp_core.runtime.agent``: the agent process."""

import sys

from resihp_core.runtime.agent import main

sys.exit(main())
