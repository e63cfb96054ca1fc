"""`python -m titanlite.generate`: the command line is in cli.py."""

import sys

from titanlite.generate.cli import main

sys.exit(main())
