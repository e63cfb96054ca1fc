"""`python -m titanlite.config [--config NAME] [overrides]`: print the resolved config (or `--help`)."""

import sys

from titanlite.config.load import main

sys.exit(main())
