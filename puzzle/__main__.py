"""`python -m puzzle` (and `torchrun -m puzzle`) runs the command line."""

import sys

from puzzle.cli import main

sys.exit(main())
