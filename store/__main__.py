"""``python -m store --help``."""

import sys

from store.cli import main

sys.exit(main())
