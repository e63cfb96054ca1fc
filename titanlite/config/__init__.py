"""The run configuration: one dataclass per TOML section (`sections.py` and a module per concern),
loaded from a TOML file and `--section.key value` overrides and validated (`load.py`) by a
generic engine that names no section (`engine.py`, `parse.py`, `output.py`). Importing this
package imports no torch: the command line checks a config before anything heavy loads.
`python -m titanlite.config` prints one. The package exports what its callers import; every
section's class is in its own module (`sections.py`, `parallelism.py`, ...).
"""

from titanlite.config.output import to_dict, to_toml
from titanlite.config.load import help_text, load_config, parse_blend, validate
from titanlite.config.float8 import Float8
from titanlite.config.records import Checkpoint, Metrics
from titanlite.config.sections import JobConfig, Training, Validation
from titanlite.config.sft import SFT

__all__ = [
    "Checkpoint",
    "Float8",
    "JobConfig",
    "Metrics",
    "SFT",
    "Training",
    "Validation",
    "help_text",
    "load_config",
    "parse_blend",
    "to_dict",
    "to_toml",
    "validate",
]
