"""``python -m tpsim`` is the ``tpsim`` command."""

import sys

from tpsim.cli import main

sys.exit(main())
