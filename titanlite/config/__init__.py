"""The run configuration: one dataclass per TOML section (`sections.py`), loaded from a TOML
file and `--section.key value` overrides and validated (`load.py`) by a generic engine that
names no section (`engine.py`). Importing this package imports no torch: the command line
checks a config before anything heavy loads. `python -m titanlite.config` prints one.
"""

from titanlite.config.output import to_dict, to_toml
from titanlite.config.load import CONFIG_DIR, help_text, load_config, main, parse_blend, validate
from titanlite.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Float8,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)

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
