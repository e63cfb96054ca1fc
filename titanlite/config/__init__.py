"""The run configuration: one dataclass per TOML section (`sections.py` and a module per concern),
loaded from a TOML file and `--section.key value` overrides and validated (`load.py`) by a
generic engine that names no section (`engine.py`, `parse.py`, `output.py`). Importing this
package imports no torch: the command line checks a config before anything heavy loads.
`python -m titanlite.config` prints one.
"""

from titanlite.config.output import to_dict, to_toml
from titanlite.config.load import CONFIG_DIR, help_text, load_config, main, parse_blend, validate
from titanlite.config.float8 import Float8
from titanlite.config.optimizer import Optimizer
from titanlite.config.parallelism import ActivationCheckpoint, Comm, Compile, Parallelism
from titanlite.config.records import Checkpoint, Metrics, Profiling
from titanlite.config.sections import Job, JobConfig, LRScheduler, Model, Training, Validation

__all__ = [
    "CONFIG_DIR",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "Float8",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Validation",
    "help_text",
    "load_config",
    "main",
    "parse_blend",
    "to_dict",
    "to_toml",
    "validate",
]
