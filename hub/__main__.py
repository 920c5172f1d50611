"""`python -m gpuflex.hub` == `gpuflex-hub`."""

import sys

from .ops.cli import main

sys.exit(main())
