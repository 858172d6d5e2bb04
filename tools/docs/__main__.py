"""``python -m tools.docs``: see :mod:`tools.docs`."""

import sys

from tools.docs import main

sys.exit(main())
