"""The run configuration: one dataclass per TOML section, loaded, overridden and validated.

`load_config(["--config", "debug_model", "--training.steps", "100"])` reads the TOML file,
applies `--section.key value` overrides on top and validates the result, so every rank
agrees on one `JobConfig` before anything touches a device. The dataclasses below are the
only description of the options: parsing follows each field's type hint, `validate` follows
each field's `choices` and range metadata, and `help_text` prints the fields' `help`.
Section and key names follow torchtitan where the two overlap.

Run `python -m titanlite.config --help` for every option, or
`python -m titanlite.config --config NAME [overrides]` to print the resolved config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import operator
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from titanlite.errors import USER_ERROR_EXIT_CODE, TitanliteError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "train_configs"
"""Where a bare `--config NAME` is looked up: the repo's shipped presets."""


def _opt(default: Any, help: str, *, choices: Sequence[str] = (), gt: float | None = None, ge: float | None = None,
         lt: float | None = None, le: float | None = None, special: Any = dataclasses.MISSING,
         nonempty: bool = False) -> Any:
    """A config field: its default, one line of help, and the rules `validate` checks.

    `special` is one extra allowed value outside the range (a -1 or None sentinel).
    """
    rules = {"help": help, "choices": tuple(choices), "gt": gt, "ge": ge, "lt": lt, "le": le, "nonempty": nonempty}
    if special is not dataclasses.MISSING:
        rules["special"] = special
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=rules)
    return field(default=default, metadata=rules)


# --------------------------------------------------------------------------------------
# The sections. Field order is the order of help_text and of the printed config.
# --------------------------------------------------------------------------------------


@dataclass
class Job:
    """Where outputs go and what the run is."""

    dump_folder: str = _opt("./outputs", "root folder for checkpoints, TensorBoard logs and traces", nonempty=True)
    description: str = _opt("", "free-text description of the run, for humans")
    print_config: bool = _opt(False, "log the resolved config at start")


@dataclass
class Model:
    """Which model to build and how to tokenize its input."""

    name: str = _opt("llama3", "model name in the registry (titanlite.models)", nonempty=True)
    flavor: str = _opt("debugmodel", "size preset of the model, e.g. debugmodel, 8B, 70B, 405B", nonempty=True)
    tokenizer_path: str = _opt("assets/tokenizer/titanlite.model", "tokenizer model file (relative paths are from the working directory)", nonempty=True)


@dataclass
class Optimizer:
    """AdamW hyperparameters."""

    name: str = _opt("AdamW", "optimizer; only AdamW is supported", choices=("AdamW",))
    lr: float = _opt(8e-4, "peak learning rate (reached at the end of warmup)", gt=0)
    beta1: float = _opt(0.9, "AdamW first-moment decay", ge=0, lt=1)
    beta2: float = _opt(0.95, "AdamW second-moment decay", ge=0, lt=1)
    eps: float = _opt(1e-8, "AdamW denominator epsilon", gt=0)
    weight_decay: float = _opt(0.1, "decoupled weight decay", ge=0)
    implementation: str = _opt("fused", "AdamW kernels: one fused kernel (CPU and GPU), multi-tensor foreach, or a "
                               "per-parameter loop", choices=("fused", "foreach", "for-loop"))


@dataclass
class LRScheduler:
    """Warmup-stable-decay learning-rate schedule."""

    warmup_steps: int = _opt(200, "steps of linear warmup from 0 to optimizer.lr", ge=0)
    decay_ratio: float | None = _opt(None, "fraction of the post-warmup steps spent decaying at the end (lr held "
                                     "stable before); none = decay over all steps after warmup", ge=0, le=1, special=None)
    decay_type: str = _opt("linear", "shape of the decay", choices=("linear", "cosine"))
    lr_min: float = _opt(0.0, "lr at the end of decay, as a fraction of optimizer.lr", ge=0, le=1)


@dataclass
class Training:
    """Data, batch shape, step count and numerics."""

    dataset: str = _opt("builtin", "data source: builtin (ships with Python), files (local text), hf (Hugging Face datasets)",
                        choices=("builtin", "files", "hf"))
    dataset_path: str = _opt("", "files: a .txt/.jsonl/.parquet file or folder; hf: a hub name or local path")
    local_batch_size: int = _opt(8, "sequences per microbatch on each data-parallel rank", gt=0)
    global_batch_size: int = _opt(-1, "sequences per optimizer step over all ranks; -1 = local_batch_size x dp degree; "
                                  "a larger multiple accumulates gradients", gt=0, special=-1)
    seq_len: int = _opt(2048, "tokens per training sequence", gt=0)
    max_norm: float = _opt(1.0, "clip gradients to this total norm; 0 disables clipping", ge=0)
    steps: int = _opt(10000, "optimizer steps to train for", gt=0)
    seed: int = _opt(42, "random seed for weight init and data order", ge=0)
    deterministic: bool = _opt(False, "use deterministic kernels (slower; for bitwise-reproducible runs)")
    mixed_precision_param: str = _opt("auto", "compute dtype of forward/backward (FSDP mixed precision, or autocast "
                                      "without FSDP); auto = bfloat16 on GPUs and on CPUs with fast native bf16 "
                                      "matmuls, else float32", choices=("auto", "float32", "bfloat16"))
    mixed_precision_reduce: str = _opt("float32", "dtype of gradient reduce-scatter/all-reduce",
                                       choices=("float32", "bfloat16"))
    enable_cpu_offload: bool = _opt(False, "keep sharded parameters, gradients and optimizer state in CPU memory")


@dataclass
class Parallelism:
    """Mesh degrees and FSDP2 / tensor-parallel options."""

    data_parallel_replicate_degree: int = _opt(1, "replicas of the model (HSDP's replicate dim; DDP-like)", ge=1)
    data_parallel_shard_degree: int = _opt(-1, "ways FSDP2 shards the model; -1 = the remaining ranks", ge=1, special=-1)
    tensor_parallel_degree: int = _opt(1, "ways each layer is split by tensor parallelism", ge=1)
    enable_loss_parallel: bool = _opt(True, "with TP: compute the loss on vocab-sharded logits without gathering them")
    fsdp_reshard_after_forward: str = _opt("default", "free gathered parameters after forward: default (all but the "
                                           "root), always, or never (more memory, less communication)",
                                           choices=("default", "always", "never"))
    fsdp_prefetch_depth: int = _opt(0, "0 = FSDP2's implicit prefetch; N > 0 explicitly prefetches the next N blocks "
                                    "in forward and backward", ge=0)
    fsdp_shard_modules: list[str] = _opt([], "module class names to fully_shard; empty = the model's transformer blocks")


@dataclass
class Checkpoint:
    """Distributed checkpoints (DCP): saving, retention, resuming and export."""

    enable_checkpoint: bool = _opt(False, "save checkpoints and resume from the newest one")
    folder: str = _opt("checkpoint", "checkpoint folder, under job.dump_folder", nonempty=True)
    interval: int = _opt(500, "save every this many steps (and at the last step)", gt=0)
    async_mode: str = _opt("async", "disabled (blocking save), async (save in the background), or "
                           "async_with_pinned_mem (faster staging through pinned memory)",
                           choices=("disabled", "async", "async_with_pinned_mem"))
    keep_latest_k: int = _opt(10, "keep only the newest k checkpoints; 0 = keep all", ge=0)
    load_step: int = _opt(-1, "step to resume from; -1 = the newest complete checkpoint", ge=0, special=-1)
    model_weights_only: bool = _opt(False, "save only model weights (no optimizer, schedule or data state)")
    export_dtype: str = _opt("float32", "dtype of weights-only exports", choices=("float32", "bfloat16", "float16"))
    initial_load_path: str = _opt("", "checkpoint to initialize from when the checkpoint folder has none")
    initial_load_format: str = _opt("dcp", "format of initial_load_path: dcp, or hf (Hugging Face safetensors)",
                                    choices=("dcp", "hf"))
    create_seed_checkpoint: bool = _opt(False, "write the initialized weights as step 0 and exit (run on 1 process)")


@dataclass
class ActivationCheckpoint:
    """Recompute activations in backward to save memory."""

    mode: str = _opt("none", "which transformer blocks recompute their activations", choices=("none", "full", "selective"))
    selective_ac_option: int = _opt(2, "with mode selective: checkpoint every k-th block", ge=1)


@dataclass
class Compile:
    """torch.compile."""

    enable: bool = _opt(False, "compile each transformer block with torch.compile")


@dataclass
class Metrics:
    """Step logging and TensorBoard."""

    log_freq: int = _opt(10, "log loss, throughput and memory every this many steps", gt=0)
    enable_tensorboard: bool = _opt(True, "write TensorBoard scalars under job.dump_folder/save_tb_folder")
    save_tb_folder: str = _opt("tb", "TensorBoard folder, under job.dump_folder", nonempty=True)
    rank_0_only: bool = _opt(True, "log (and write TensorBoard) only on rank 0")
    peak_flops: float = _opt(0.0, "peak FLOP/s per device for MFU; 0 = the known-GPU table, or on CPU a matmul "
                             "measured at start-up", ge=0)


@dataclass
class Profiling:
    """torch.profiler traces."""

    enable_profiling: bool = _opt(False, "record torch.profiler traces")
    save_traces_folder: str = _opt("profile_traces", "trace folder, under job.dump_folder", nonempty=True)
    profile_freq: int = _opt(10, "record one trace every this many steps", gt=0)


@dataclass
class Comm:
    """Process-group timeouts."""

    init_timeout_seconds: int = _opt(300, "timeout of collectives until the first step (start-up, loading)", gt=0)
    train_timeout_seconds: int = _opt(100, "timeout of collectives during training", gt=0)


@dataclass
class JobConfig:
    """The whole run configuration: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)


# --------------------------------------------------------------------------------------
# Schema: everything below is derived from the dataclasses above.
# --------------------------------------------------------------------------------------


@functools.cache
def _sections() -> dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


@functools.cache
def _keys(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    """Key name -> (resolved type hint, dataclass field) for one section."""
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def _optional_inner(tp: Any) -> Any | None:
    """X for `X | None` / Optional[X], else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_type_name(inner)} | none"
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _expected(tp: Any) -> str:
    """What a value of type `tp` is, in words, for error messages."""
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_expected(inner)} or none"
    if typing.get_origin(tp) is list:
        return "a list of strings"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}[tp]


_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def _is_type(value: Any, tp: Any) -> bool:
    """Whether `value` is a valid Python value for a field typed `tp` (ints count as floats)."""
    inner = _optional_inner(tp)
    if inner is not None:
        return value is None or _is_type(value, inner)
    if typing.get_origin(tp) is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _coerce(value: Any, tp: Any) -> Any:
    """A TOML value checked against `tp` (ints widened to float); ValueError if it is the wrong type."""
    if _optional_inner(tp) is not None and isinstance(value, str) and value.strip().lower() == "none":
        return None  # TOML has no null; files and the CLI spell it "none"
    if not _is_type(value, tp):
        raise ValueError
    if isinstance(value, list):
        return list(value)
    return float(value) if isinstance(value, int) and float in (tp, _optional_inner(tp)) else value


def _parse_cli(text: str, tp: Any) -> Any:
    """A command-line string parsed as `tp`; ValueError if it does not parse."""
    inner = _optional_inner(tp)
    if inner is not None:
        return None if text.strip().lower() == "none" else _parse_cli(text, inner)
    if typing.get_origin(tp) is list:
        stripped = text.strip()
        if stripped.startswith("["):  # TOML-style ["a", "b"]
            try:
                value = tomllib.loads(f"v = {stripped}")["v"]
            except tomllib.TOMLDecodeError as error:
                raise ValueError from error
            return _coerce(value, tp)
        return [part.strip() for part in text.split(",") if part.strip()]
    if tp is bool:
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError
    if tp is int:
        return int(text)
    if tp is float:
        return float(text)
    return text


def _closest(name: str, candidates: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def _hint(suggestion: str | None) -> str:
    return f"; did you mean {suggestion}?" if suggestion else ""


def _suggest_key(section: str, key: str) -> str | None:
    """The valid `section.key` closest to a misspelt or misplaced one (None if nothing is close)."""
    sections = _sections()
    if section in sections and (close := _closest(key, list(_keys(sections[section])))):
        return f"{section}.{close}"
    homes = [s for s, cls in sections.items() if key in _keys(cls)]
    if homes:  # a right key in a wrong or missing section
        best = difflib.get_close_matches(section, homes, n=1, cutoff=0.0) if section else homes
        return f"{best[0]}.{key}"
    if section in sections:
        return None
    everything = [f"{s}.{k}" for s, cls in sections.items() for k in _keys(cls)]
    return _closest(f"{section}.{key}" if section else key, everything)


def _lookup(section: str, key: str, where: str) -> tuple[Any, dataclasses.Field]:
    """The (type, field) of `section.key`, or a TitanliteError naming it and the closest name."""
    sections = _sections()
    keys = _keys(sections[section]) if section in sections else {}
    if key not in keys:
        shown = f"{section}.{key}" if section else key
        raise TitanliteError(f"unknown key {shown} {where}{_hint(_suggest_key(section, key))}")
    return keys[key]


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def _find_config(name: str) -> tuple[Path, str]:
    """The file for `--config NAME` and how to name it in messages: as given, then in train_configs/."""
    names = [name] if name.endswith(".toml") else [name, f"{name}.toml"]
    for candidate in names:
        if Path(candidate).is_file():
            return Path(candidate), candidate
    for candidate in names:
        if (CONFIG_DIR / candidate).is_file():
            return CONFIG_DIR / candidate, candidate
    raise TitanliteError(f"config file not found: {name} (looked in ./ and train_configs/)")


def _read_toml(path: Path, shown: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as error:
        message = " ".join(str(error).split())
        raise TitanliteError(f"invalid TOML in {shown}: {message}") from None
    except UnicodeDecodeError:
        raise TitanliteError(f"invalid TOML in {shown}: the file is not UTF-8 text") from None
    except OSError as error:
        raise TitanliteError(f"cannot read config file {shown}: {error.strerror}") from None


def _apply_toml(cfg: JobConfig, data: dict[str, Any], shown: str) -> None:
    """Set every `[section] key = value` of a parsed TOML file on `cfg`, checking names and types."""
    where = f"in {shown}"
    sections = _sections()
    for section, table in data.items():
        if not isinstance(table, dict):
            raise TitanliteError(f"unknown key {section} {where} (keys belong in a [section]){_hint(_suggest_key('', section))}")
        if section not in sections:
            close = _closest(section, list(sections))
            raise TitanliteError(f"unknown section [{section}] {where}{_hint(f'[{close}]' if close else None)}")
        for key, value in table.items():
            tp, _ = _lookup(section, key, where)
            try:
                setattr(getattr(cfg, section), key, _coerce(value, tp))
            except ValueError:
                raise TitanliteError(f"{section}.{key}: expected {_expected(tp)}, got {value!r} {where}") from None


def _split_argv(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str, Any]]]:
    """(--config value, [(section, key, parsed value), ...]) from the command line, in order."""
    config: str | None = None
    overrides: list[tuple[str, str, Any]] = []
    where = "on the command line"
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            raise TitanliteError(f"unexpected argument {arg!r}; options are --config NAME and --section.key value")
        name, has_value, value = arg[2:].partition("=")
        nxt = argv[i] if i < len(argv) else None
        takes_next = not has_value and nxt is not None and not nxt.startswith("--")
        if name == "config":
            if takes_next:
                value, i = nxt, i + 1
            if not value:
                raise TitanliteError("--config needs a value: a TOML path or a name in train_configs/")
            if config is not None:
                raise TitanliteError(f"--config given twice ({config} and {value})")
            config = value
            continue
        section, _, key = name.rpartition(".")
        tp, _ = _lookup(section, key, where)
        if not has_value:
            if takes_next:
                value, i = nxt, i + 1
            elif tp is bool:
                value = "true"  # a bare --section.flag switches it on
            else:
                raise TitanliteError(f"{section}.{key}: --{name} needs a value ({_expected(tp)})")
        try:
            overrides.append((section, key, _parse_cli(value, tp)))
        except ValueError:
            raise TitanliteError(f"{section}.{key}: expected {_expected(tp)}, got {value!r}") from None
    return config, overrides


def load_config(argv: Sequence[str]) -> JobConfig:
    """Defaults <- `--config` TOML <- `--section.key value` overrides, then `validate`.

    Without `--config` the dataclass defaults are the base. `-h`/`--help` prints `help_text()`
    and raises SystemExit(0).
    """
    if "-h" in argv or "--help" in argv:
        print(help_text())
        raise SystemExit(0)
    config, overrides = _split_argv(argv)
    cfg = JobConfig()
    if config is not None:
        path, shown = _find_config(config)
        _apply_toml(cfg, _read_toml(path, shown), shown)
    for section, key, value in overrides:
        setattr(getattr(cfg, section), key, value)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def _range_text(meta: dict[str, Any]) -> str:
    """What a field's range rules require, in words ('> 0', '-1 or >= 1'), or '' when it has none."""
    lo = ("[", meta["ge"]) if meta["ge"] is not None else ("(", meta["gt"]) if meta["gt"] is not None else None
    hi = ("]", meta["le"]) if meta["le"] is not None else (")", meta["lt"]) if meta["lt"] is not None else None
    if lo is None and hi is None:
        return ""
    if lo and hi:
        text = f"in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    elif lo:
        text = f"{'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
    else:
        text = f"{'<=' if hi[0] == ']' else '<'} {hi[1]:g}"
    if "special" in meta:
        special = "none" if meta["special"] is None else meta["special"]
        return f"{special} or {text}"
    return text


def _in_range(value: Any, meta: dict[str, Any]) -> bool:
    if "special" in meta and value == meta["special"] and type(value) is type(meta["special"]):
        return True
    if value is None:
        return False
    bounds = ((meta["gt"], operator.gt), (meta["ge"], operator.ge), (meta["lt"], operator.lt), (meta["le"], operator.le))
    return all(bound is None or compare(value, bound) for bound, compare in bounds)


def _check_field(section: str, key: str, tp: Any, f: dataclasses.Field, value: Any) -> None:
    """Type, finiteness, choices and range of one value, from its field's metadata."""
    name, meta = f"{section}.{key}", f.metadata
    if not _is_type(value, tp):
        raise TitanliteError(f"{name}: expected {_expected(tp)} (got {value!r})")
    if isinstance(value, float) and not math.isfinite(value):
        raise TitanliteError(f"{name}: must be a finite number (got {value!r})")
    if meta["choices"] and value not in meta["choices"]:
        raise TitanliteError(f"{name}: must be one of {', '.join(meta['choices'])} (got {value!r})")
    if meta["nonempty"] and not value:
        raise TitanliteError(f"{name}: must not be empty (got {value!r})")
    rule = _range_text(meta)
    if rule and not _in_range(value, meta):
        raise TitanliteError(f"{name}: must be {rule} (got {value!r})")


def validate(cfg: JobConfig) -> None:
    """Raise TitanliteError on the first value or combination that cannot work.

    Only checks that need neither a device nor the world size; mesh degrees against the
    world size are ParallelDims' job, model/flavor names the registry's.
    """
    for section, section_cls in _sections().items():
        values = getattr(cfg, section)
        if not isinstance(values, section_cls):
            raise TitanliteError(f"{section}: expected a [{section}] section (got {values!r})")
        for key, (tp, f) in _keys(section_cls).items():
            _check_field(section, key, tp, f, getattr(values, key))

    training, parallelism = cfg.training, cfg.parallelism
    if training.global_batch_size != -1 and training.global_batch_size % training.local_batch_size:
        raise TitanliteError(
            f"training.global_batch_size: must be -1 or a multiple of training.local_batch_size "
            f"{training.local_batch_size} (got {training.global_batch_size})"
        )
    if training.dataset in ("files", "hf") and not training.dataset_path:
        raise TitanliteError(f"training.dataset_path: dataset {training.dataset!r} needs a path (got '')")
    if training.enable_cpu_offload and parallelism.fsdp_reshard_after_forward == "never":
        raise TitanliteError(
            "training.enable_cpu_offload: CPU offload needs resharding after forward "
            "(got parallelism.fsdp_reshard_after_forward = 'never')"
        )
    if cfg.checkpoint.load_step != -1 and not cfg.checkpoint.enable_checkpoint:
        raise TitanliteError(
            f"checkpoint.load_step: resuming from step {cfg.checkpoint.load_step} needs "
            "checkpoint.enable_checkpoint = true"
        )
    for name in parallelism.fsdp_shard_modules:
        if not name.isidentifier():
            raise TitanliteError(f"parallelism.fsdp_shard_modules: {name!r} is not a class name "
                                 f"(got {parallelism.fsdp_shard_modules!r})")


# --------------------------------------------------------------------------------------
# Output: help, dict, TOML
# --------------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def help_text() -> str:
    """Every `--section.key`, its type, default and help, grouped by section."""
    lines = [
        "usage: python -m titanlite.train [--config NAME] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "  --config NAME   a TOML file path, or a name in train_configs/ (e.g. debug_model)",
        "  Overrides win over the TOML file. Booleans: true/false/1/0/yes/no, or a bare --section.flag for true.",
        "  Lists: a,b or [\"a\", \"b\"]. Optional numbers: none.",
    ]
    for section, section_cls in _sections().items():
        lines += ["", f"[{section}]  {(section_cls.__doc__ or '').strip()}"]
        for key, (tp, f) in _keys(section_cls).items():
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            kind = "|".join(f.metadata["choices"]) if f.metadata["choices"] else _type_name(tp)
            rule = _range_text(f.metadata)
            lines.append(f"  --{section}.{key}  {kind} = {_toml_value(default)}{f'  ({rule})' if rule else ''}")
            lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as nested plain dicts (section -> key -> value), for logs and checkpoints."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: JobConfig) -> str:
    """The config as TOML text that `load_config` reads back to an equal config."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines += [f"[{section}]"] + [f"{key} = {_toml_value(value)}" for key, value in values.items()] + [""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m titanlite.config [--config NAME] [overrides]`: print the resolved config."""
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
    except TitanliteError as error:
        print(f"titanlite: error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    print(to_toml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
