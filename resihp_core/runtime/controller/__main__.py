"""``python -m resihp_core.runtime.controller``: the controller process."""

import sys

from resihp_core.runtime.controller import main

sys.exit(main())
