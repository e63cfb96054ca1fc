"""Loading a run configuration: TOML file, then `--section.key value` overrides, then validation.

`load_config(["--config", "debug_model", "--training.steps", "100"])` reads the TOML file,
applies the overrides on top and validates the result, so every rank agrees on one
`JobConfig` (sections.py) before anything touches a device. This module adds what is ours
to the generic engine (engine.py): where `--config NAME` is looked up and the rules that
combine several keys.

Run `python -m titanlite.config --help` for every option, or
`python -m titanlite.config --config NAME [overrides]` to print the resolved config.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from titanlite.config.engine import check_values
from titanlite.config.parse import Override, apply_toml, cli_pairs, parse_override, read_toml, refuse_repeats
from titanlite.config.output import help_lines, to_toml
from titanlite.config.fault_tolerance import check_fault_tolerance
from titanlite.config.float8 import check_float8
from titanlite.config.lora import check_lora
from titanlite.config.param_groups import parse_groups
from titanlite.config.sections import JobConfig
from titanlite.config.torchtitan import TorchtitanKeys
from titanlite.errors import USER_ERROR_EXIT_CODE, TitanliteError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "train_configs"
"""Where a bare `--config NAME` is looked up: the repo's shipped presets."""


# --------------------------------------------------------------------------------------
# Loading: the generic parts (names, types, help, TOML) are engine.py, parse.py and output.py's.
# --------------------------------------------------------------------------------------

_CLI_USAGE = "--config NAME and --section.key value"


def _find_config(name: str) -> tuple[Path, str]:
    """The file for `--config NAME` and how to name it in messages: as given, then in train_configs/."""
    names = [name] if name.endswith(".toml") else [name, f"{name}.toml"]
    for path, candidate in [(Path(c), c) for c in names] + [(CONFIG_DIR / c, c) for c in names]:
        if path.is_file():
            return path, candidate
    if Path(name).is_dir():
        raise TitanliteError(f"--config: {name} is a folder, not a TOML file")
    raise TitanliteError(f"config file not found: {name} (looked in ./ and train_configs/)")


def _split_argv(argv: Sequence[str], translate: TorchtitanKeys) -> tuple[str | None, list[Override]]:
    """(--config value, [(section, key, parsed value), ...]) from the command line, in order."""
    config: str | None = None
    overrides: list[Override] = []
    for name, value in cli_pairs(argv, _CLI_USAGE):
        if name != "config":
            if (override := parse_override(JobConfig, name, value, translate)) is not None:
                overrides.append(override)
            continue
        if not value:
            raise TitanliteError("--config needs a value: a TOML path or a name in train_configs/")
        if config is not None:
            raise TitanliteError(f"--config given twice ({config} and {value})")
        config = value
    refuse_repeats(overrides)
    return config, overrides


def load_config(argv: Sequence[str], notices: list[str] | None = None) -> JobConfig:
    """Defaults <- `--config` TOML <- `--section.key value` overrides, then `validate`.

    Without `--config` the dataclass defaults are the base. torchtitan's names are read as
    theirs (torchtitan.py); what they do not change here is appended to `notices`, for the
    caller to say once. `-h`/`--help` prints `help_text()` and raises SystemExit(0).
    """
    if "-h" in argv or "--help" in argv:
        print(help_text())
        raise SystemExit(0)
    translate = TorchtitanKeys()
    config, overrides = _split_argv(argv, translate)
    cfg = JobConfig()
    if config is not None:
        path, shown = _find_config(config)
        data = read_toml(path, shown)
        translate.refuse_absent_model(data, shown, overrides)
        apply_toml(cfg, data, shown, translate)
    for section, key, value in overrides:
        setattr(getattr(cfg, section), key, value)
    translate.finish(cfg, {(section, key) for section, key, _ in overrides})
    validate(cfg)
    if notices is not None:
        notices.extend(translate.notices)
    return cfg


# --------------------------------------------------------------------------------------
# Validation: each value against its field's rules, then the combinations that cannot work
# --------------------------------------------------------------------------------------


def validate(cfg: JobConfig) -> None:
    """Raise TitanliteError on the first value or combination that cannot work.

    Only checks that need neither a device nor the world size; mesh degrees against the
    world size are ParallelDims' job, model/flavor names the registry's.
    """
    check_values(cfg)
    check_fault_tolerance(cfg.fault_tolerance)
    parse_groups(cfg.optimizer.param_groups)
    _check_batch_and_data(cfg)
    _check_layout(cfg)
    check_float8(cfg.model.converters, cfg.float8)
    check_lora(cfg.model.converters, cfg.lora)
    for name in cfg.parallelism.fsdp_shard_modules:
        if not name.isidentifier():
            raise TitanliteError(
                f"parallelism.fsdp_shard_modules: {name!r} is not a class name "
                f"(got {cfg.parallelism.fsdp_shard_modules!r})"
            )


def _check_batch_and_data(cfg: JobConfig) -> None:
    """The global batch against the local one; the training and validation data's paths."""
    training, validation = cfg.training, cfg.validation
    if training.global_batch_size != -1 and training.global_batch_size % training.local_batch_size:
        raise TitanliteError(
            f"training.global_batch_size: must be -1 or a multiple of training.local_batch_size "
            f"{training.local_batch_size} (got {training.global_batch_size})"
        )
    for name, data in (("training", training), ("validation", validation)):
        if data.dataset in ("files", "prepared", "chat") and not data.dataset_path:
            raise TitanliteError(f"{name}.dataset_path: dataset {data.dataset!r} needs a path (got '')")
        if data.dataset == "prepared":
            parse_blend(data.dataset_path, f"{name}.dataset_path")
    if not validation.dataset and validation.enable and validation.holdout_fraction == 0:
        raise TitanliteError(
            "validation.holdout_fraction: 0 holds no window out for validation (validation.dataset "
            "is empty, so validation reads the held-out split; got 0)"
        )


def _check_layout(cfg: JobConfig) -> None:
    """FSDP's resharding, CPU offload, resuming, the pipeline's split and selective AC: the
    string options' forms and the keys that only work together."""
    parallelism = cfg.parallelism
    reshard = parallelism.fsdp_reshard_after_forward
    if reshard not in ("default", "always", "never") and not (reshard.isdigit() and int(reshard) >= 1):
        raise TitanliteError(
            f"parallelism.fsdp_reshard_after_forward: must be default, always, never or a number of ranks >= 1 "
            f"(got {reshard!r})"
        )
    if cfg.training.enable_cpu_offload and reshard == "never":
        raise TitanliteError(
            "training.enable_cpu_offload: CPU offload needs resharding after forward "
            "(got parallelism.fsdp_reshard_after_forward = 'never')"
        )
    if cfg.checkpoint.load_step != -1 and not cfg.checkpoint.enable_checkpoint:
        raise TitanliteError(
            f"checkpoint.load_step: resuming from step {cfg.checkpoint.load_step} needs "
            "checkpoint.enable_checkpoint = true"
        )
    if parallelism.pipeline_parallel_split_points and parallelism.pipeline_parallel_layers_per_stage is not None:
        raise TitanliteError(
            "parallelism.pipeline_parallel_split_points: give it or pipeline_parallel_layers_per_stage, "
            f"not both (got {','.join(parallelism.pipeline_parallel_split_points)} and "
            f"{parallelism.pipeline_parallel_layers_per_stage} layers per stage)"
        )
    option = cfg.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise TitanliteError(
            f"activation_checkpoint.selective_ac_option: must be a whole number >= 1 or op (got {option!r})"
        )


def parse_blend(value: str, field: str) -> list[tuple[str, float]]:
    """`folder`, or `folder:weight,folder:weight,...` (weights >= 0, relative, summing above 0),
    as (folder, weight) pairs; one line naming `field` for anything else."""
    entries = [entry.strip() for entry in value.split(",")]
    if len(entries) == 1 and ":" not in entries[0]:
        return [(entries[0], 1.0)]
    blend = []
    for entry in entries:
        folder, _, text = entry.rpartition(":")
        try:
            weight = float(text)
        except ValueError:
            weight = float("nan")
        if not folder or not (weight >= 0 and weight != float("inf")):
            raise TitanliteError(f"{field}: {entry!r} is not folder:weight with a weight >= 0 (got {value!r})")
        blend.append((folder, weight))
    if sum(w for _, w in blend) <= 0:
        raise TitanliteError(f"{field}: the blend weights sum to 0 (got {value!r})")
    return blend


# --------------------------------------------------------------------------------------
# Output and the module entry point (to_dict and to_toml come from config.output)
# --------------------------------------------------------------------------------------

_USAGE = [
    "usage: python -m titanlite.train [--config NAME] [--section.key VALUE | --section.key=VALUE ...]",
    "",
    "  --config NAME   a TOML file path, or a name in train_configs/ (e.g. debug_model)",
    "  Overrides win over the TOML file. Booleans: true/false/1/0/yes/no, or a bare --section.flag for true.",
    '  Lists: a,b or ["a", "b"]. Optional numbers: none.',
]


def help_text() -> str:
    """Every `--section.key`, its type, default and help, grouped by section."""
    return "\n".join(_USAGE + help_lines(JobConfig))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m titanlite.config [--config NAME] [overrides]`: print the resolved config."""
    try:
        print(to_toml(load_config(sys.argv[1:] if argv is None else argv)), end="")
    except TitanliteError as error:
        print(f"titanlite: error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except BrokenPipeError:  # `... --help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
