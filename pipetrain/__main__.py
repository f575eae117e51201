"""``python -m pipetrain``: the ``pipetrain`` command (see :mod:`pipetrain.tools.cli`)."""

import sys

from pipetrain.tools.cli import main

sys.exit(main())
