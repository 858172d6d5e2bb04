"""``python -m tpsim.docs``: see :mod:`tpsim.docs`."""

import sys

from tpsim.docs import main

sys.exit(main())
