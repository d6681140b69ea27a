"""``python -m resihp_core.cli``: the ``resihp`` command."""

import sys

from resihp_core.cli import main

sys.exit(main())
