"""Weights & Biases logging (`metrics.enable_wandb`, the `wandb` extra): rank 0's scalars go
to a W&B run under TensorBoard's names and steps (`MetricsLogger` feeds both), with the run's
resolved config as the W&B run's config.

The W&B run is described by the environment, with the variables torchtitan's WandBLogger
reads: WANDB_PROJECT (default "titanlite"), WANDB_TEAM (the entity), WANDB_RUN_NAME,
WANDB_RUN_ID, WANDB_RUN_NOTES, WANDB_RUN_TAGS (comma-separated), WANDB_RUN_GROUP,
WANDB_RUN_JOB_TYPE, WANDB_RESUME_FROM and WANDB_FORK_FROM; wandb's own variables
(WANDB_MODE=offline, WANDB_API_KEY, ...) apply as usual. Its local files go in the run folder
(`<run folder>/wandb/`) unless WANDB_DIR names another place.

wandb is imported only where a W&B run starts: `import titanlite`, runs without the option and
ranks other than 0 never load it. Before the trainer touches a device (`require_wandb`) every
rank checks that it is installed (without importing it) and that WANDB_MODE names a mode, and
rank 0 imports it: an install that fails to import (a version clash with protobuf or pydantic)
is one line there, not a traceback after the model is built.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titanlite.config import Metrics
from titanlite.errors import TitanliteError, one_line

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

DEFAULT_PROJECT = "titanlite"
# The values wandb's settings accept for WANDB_MODE (wandb 0.31; "dryrun" and "run" are its old names).
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")
# wandb.init's argument -> the environment variable it is read from (torchtitan's names)
RUN_FROM_ENV = {
    "entity": "WANDB_TEAM",
    "name": "WANDB_RUN_NAME",
    "id": "WANDB_RUN_ID",
    "notes": "WANDB_RUN_NOTES",
    "group": "WANDB_RUN_GROUP",
    "job_type": "WANDB_RUN_JOB_TYPE",
    "resume_from": "WANDB_RESUME_FROM",
    "fork_from": "WANDB_FORK_FROM",
}


def require_wandb(metrics_cfg: Metrics) -> None:
    """With `metrics.enable_wandb` on, the wandb package must be installed (found, not imported,
    on ranks that never log) and WANDB_MODE must be one of wandb's modes; rank 0, which logs,
    imports it now. Each is one line before any device is used. The rank is read from torchrun's
    environment, as `errors.report_user_error` does: this runs before the process group exists."""
    if not metrics_cfg.enable_wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        raise TitanliteError(
            "metrics.enable_wandb: logging to Weights & Biases needs the wandb package: pip install wandb"
        )
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:
        raise TitanliteError(
            f"metrics.enable_wandb: WANDB_MODE={mode!r} is not one of wandb's modes ({', '.join(WANDB_MODES)})"
        )
    if int(os.environ.get("RANK", 0)) == 0:
        _import_wandb()


def _import_wandb() -> Any:
    """The wandb module, or one line when the installed package fails to import."""
    try:
        import wandb
    except Exception as error:  # an install broken in any way: ImportError, a dependency's own error
        raise TitanliteError(
            f"metrics.enable_wandb: the installed wandb package fails to import ({one_line(error)}); "
            "reinstall it: pip install --force-reinstall wandb"
        ) from None
    return wandb


def start_wandb_run(run_config: dict[str, Any], run_dir: Path) -> Run:
    """A W&B run described by the environment (module docstring) recording `run_config`.
    What wandb refuses as a usage error (no API key online, a malformed WANDB_RUN_ID) is one line."""
    wandb = _import_wandb()
    tags = os.environ.get("WANDB_RUN_TAGS")
    described = {arg: os.environ.get(variable) for arg, variable in RUN_FROM_ENV.items()}
    try:
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            dir=os.environ.get("WANDB_DIR", str(run_dir)),
            config=run_config,
            tags=tags.split(",") if tags else None,
            **described,
        )
    except wandb.errors.UsageError as error:
        raise TitanliteError(
            f"metrics.enable_wandb: W&B refused the run: {error} (WANDB_MODE=offline logs locally without an account)"
        ) from None
