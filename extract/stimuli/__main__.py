import sys

from extract.stimuli.cli import main

sys.exit(main())
