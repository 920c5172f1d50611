"""`python -m gpuflex.hub` == `gpuflex-hub`."""

import sys

from .cli import main

sys.exit(main())
