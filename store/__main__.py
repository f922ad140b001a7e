"""``python -m store --help``."""

import signal
import sys

from store.cli import main

# `python -m store info | head`: a reader that stops early ends the listing quietly, as any Unix
# tool's, not with a BrokenPipeError traceback (this CLI only prints; its writes hold no state then).
if hasattr(signal, "SIGPIPE"):
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
sys.exit(main())
