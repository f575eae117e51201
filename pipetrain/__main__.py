"""``python -m pipetrain``: the ``pipetrain`` command (see :mod:`pipetrain.cli`)."""

import sys

from pipetrain.cli import main

sys.exit(main())
