import sys

from stimuli.cli import main

sys.exit(main())
