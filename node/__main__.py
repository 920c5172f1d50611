"""``python -m gpuflex.node`` == ``gpuflex-node``."""

import sys

from .cli import main

sys.exit(main())
