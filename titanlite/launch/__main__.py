"""`python -m titanlite.launch [torchrun args] -m titanlite.train ...` (see `titanlite/launch/__init__.py`)."""

import sys

from titanlite.launch import main

sys.exit(main())
