"""torchtitan's own TOML files, read as they are: its names for titanlite's options, and its
options titanlite does not have.

- Aliases, one home each: `checkpoint.enable` is `checkpoint.enable_checkpoint`,
  `checkpoint.last_save_model_only` is `checkpoint.model_weights_only`, `lr_scheduler.min_lr_factor`
  is `lr_scheduler.lr_min`. (`model.hf_assets_path` and the string forms of
  `activation_checkpoint.selective_ac_option` are options of their own, in sections.py.)
- Options titanlite does not have are accepted with one notice when set to what they are off
  (or to no effect), and refused in one line when they would change the run:
  `parallelism.enable_async_tensor_parallel`, `optimizer.early_step_in_backward` (torchtitan's
  other optimizer keys are titanlite's; it has no parameter groups, so its files train with
  `optimizer.param_groups = []`, every parameter decayed alike, with a notice);
  `metrics.disable_color_printing` and `compile.components` have no effect to have (titanlite
  prints no colors; `compile.enable` compiles every block).
- `[quantize.linear.float8]` (file) and `--quantize.linear.float8.KEY` are the `[float8]`
  section; its `emulate` is a notice (titanlite emulates exactly where the device has no float8
  matmuls). The other `[quantize.*]` tables (mx, grouped_mm) hold settings of conversions that
  `model.converters` refuses by name (`float8.REFUSED_CONVERTERS`): a notice. In `model.converters`,
  torchtitan's `quantize.linear.float8` is `float8`.
- Datasets torchtitan downloads (`c4`, `c4_test`, `c4_validation`) are refused with the line
  that says how to prepare one locally, unless a command-line override names another
  dataset (overrides win, as everywhere); a validation dataset of that kind is only a
  notice while validation is off.
- A file that names any of the keys above is torchtitan's, and its flavor names are torchtitan's:
  for the model families titanlite has (llama3, qwen3, deepseek_v3) `model.flavor = "debugmodel"`
  becomes `torchtitan:debugmodel`, torchtitan v0.2.2's shape (models/<family>/__init__.py), with a
  notice, so the file trains what it trains under torchtitan; titanlite's own, faster debug
  flavors stay for titanlite's files. A family titanlite does not have (llama4, flux, ...) is refused by name before
  any key of its file is read: those keys would otherwise be the first error, and a misleading one.
  A torchtitan file of gpt_oss (a family titanlite has, without torchtitan's flavors) is refused.
- `model.num_nextn_predict_layers` (DeepSeek-V3's multi-token prediction) is refused unless 0: its
  depth is the flavor's (`debugmodel_mtp`) or config.json's.

Notices are collected (`TorchtitanKeys.notices`); the command lines print them once, rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from titanlite.config.float8 import REFUSED_CONVERTERS
from titanlite.errors import TitanliteError

if TYPE_CHECKING:
    from titanlite.config.parse import Override
    from titanlite.config.sections import JobConfig

ALIASES = {
    ("checkpoint", "enable"): "enable_checkpoint",
    ("checkpoint", "last_save_model_only"): "model_weights_only",
    ("lr_scheduler", "min_lr_factor"): "lr_min",
}
# (section, key): (the value that leaves it off, what titanlite does instead)
OFF_ONLY = {
    ("optimizer", "early_step_in_backward"): (
        False,
        "titanlite steps the optimizer once after backward, never per parameter inside it",
    ),
    ("parallelism", "enable_async_tensor_parallel"): (False, "titanlite has no async tensor parallelism"),
    # DeepSeek-V3's config name for its multi-token prediction modules.
    ("model", "num_nextn_predict_layers"): (
        0,
        "DeepSeek-V3's multi-token prediction depth is its flavor's (e.g. debugmodel_mtp) or its config.json's",
    ),
}
NO_EFFECT = {
    ("metrics", "disable_color_printing"): "titanlite prints no colors",
    ("compile", "components"): "compile.enable compiles each transformer block; the loss runs eager",
    ("quantize.linear.float8", "emulate"): (
        "titanlite emulates float8 exactly where the device has no float8 matmuls (an SM >= 8.9 GPU)"
    ),
}
DOWNLOADED_DATASETS = ("c4", "c4_test", "c4_validation")
FLOAT8_SECTION = ("quantize", "linear", "float8")  # torchtitan v0.2's home of the [float8] keys
# torchtitan v0.2.2's model families (torchtitan/models/__init__.py): those titanlite has, whose
# torchtitan flavors are registered as FLAVOR_PREFIX + name, and those it does not have.
SHARED_MODELS = ("deepseek_v3", "llama3", "qwen3")
ABSENT_MODELS = ("flux", "llama3_ft", "llama4")
# Families titanlite has without torchtitan's flavors: a torchtitan file of one is refused.
UNMAPPED_MODELS = ("gpt_oss",)
FLAVOR_PREFIX = "torchtitan:"
_COMMAND_LINE = "on the command line"  # the `where` of an override (config/parse.py)
_PREPARE = (
    "titanlite reads local data prepared once into token shards: python -m titanlite.data.prepare "
    'hf:allenai/c4:en prepared/ --tokenizer TOKENIZER (pip install titanlite[hf]), then dataset = "prepared" '
    'and dataset_path = "prepared/" (docs/data.md)'
)


def _is_off(value: Any, off: bool | int) -> bool:
    """Whether a TOML value, or an override's text, is an option's off value (a boolean or a number)."""
    if isinstance(off, bool):
        on = value.strip().lower() in ("true", "1", "yes", "on") if isinstance(value, str) else bool(value)
        return on == off
    return not isinstance(value, bool) and str(value).strip() == str(off)


def _downloaded_error(section: str, dataset: str) -> TitanliteError:
    return TitanliteError(f"{section}.dataset: {dataset!r} is a dataset torchtitan downloads at run time; {_PREPARE}")


class TorchtitanKeys:
    """The translation `config.parse` applies to each key before looking it up."""

    def __init__(self) -> None:
        self.notices: list[str] = []
        self._downloaded: dict[str, tuple[str, str]] = {}  # section -> (dataset, where) from a file, decided in finish
        self._file: str | None = None  # the `where` of a file read as torchtitan's
        self._groups_given = False  # optimizer.param_groups set by the file or the command line

    def __call__(self, section: str, key: str | None, value: Any, where: str) -> tuple[str, str, Any] | None:
        """The (section, key, value) to set, or None when this key is handled here."""
        pair = (section, key)
        # A key (key None: a section) only torchtitan's files name makes the file torchtitan's.
        theirs = key is None or any(pair in table for table in (ALIASES, OFF_ONLY, NO_EFFECT))
        if where != _COMMAND_LINE and (theirs or (key == "dataset" and value in DOWNLOADED_DATASETS)):
            self._file = where
        if pair == ("optimizer", "param_groups"):
            self._groups_given = True
        if key is None:  # a whole section titanlite does not have: torchtitan's [quantize] is the one it knows
            return self._section(section, value, where) if section == "quantize" else None
        if pair in ALIASES:
            return section, ALIASES[pair], value
        if pair == ("activation_checkpoint", "selective_ac_option") and type(value) is int:
            return section, key, str(value)  # the number form of the string option ('2' in torchtitan's files)
        if pair in OFF_ONLY:
            off, instead = OFF_ONLY[pair]
            if not _is_off(value, off):
                raise TitanliteError(
                    f"{section}.{key}: not supported ({instead}); set it to {str(off).lower()} or leave it out"
                )
            self.notices.append(f"{section}.{key} = {str(off).lower()} {where}: torchtitan's option, off; {instead}")
            return None
        if pair in NO_EFFECT:
            self.notices.append(f"{section}.{key} {where}: torchtitan's option, no effect here: {NO_EFFECT[pair]}")
            return None
        if key == "dataset" and section in ("training", "validation") and value in DOWNLOADED_DATASETS:
            if section == "training" and where == _COMMAND_LINE:
                raise _downloaded_error(section, value)
            self._downloaded[section] = (value, where)
            return None
        if section == ".".join(FLOAT8_SECTION):  # a key of the file's table, or the command line's --quantize...KEY
            return "float8", key, value
        return section, key, value

    def _section(self, section: str, table: Any, where: str) -> list[tuple[str, str, Any]]:
        """torchtitan's nested [quantize.<kind>.<format>] tables: float8 linears' keys for the
        [float8] section; the others (mx, grouped_mm) a notice each."""
        found = []
        for kind, formats in table.items():
            for name, keys in formats.items() if isinstance(formats, dict) else [(None, formats)]:
                shown = ".".join(part for part in (section, kind, name) if part)
                if not isinstance(keys, dict):
                    raise TitanliteError(f"[{shown}] {where}: expected a table of keys, got {keys!r}")
                if (section, kind, name) == FLOAT8_SECTION:
                    found += [mapped for k, v in keys.items() if (mapped := self(shown, k, v, where))]
                elif shown in REFUSED_CONVERTERS:
                    self.notices.append(
                        f"[{shown}] {where}: torchtitan's settings of a conversion titanlite does not have "
                        "(model.converters refuses it), not used"
                    )
                else:
                    raise TitanliteError(
                        f"unknown section [{shown}] {where}: the quantize tables are quantize.linear.float8, "
                        "quantize.linear.mx, quantize.grouped_mm.float8 and quantize.grouped_mm.mx"
                    )
        return found

    def refuse_absent_model(self, data: dict[str, Any], shown: str, overrides: Sequence[Override]) -> None:
        """Before a file's keys are read: its model, or the command line's, is not a torchtitan
        family titanlite lacks (a key or the flavor of that family's file would otherwise be the
        first error, and a misleading one)."""
        model = data.get("model")
        name, where = (model.get("name") if isinstance(model, dict) else None), f"in {shown}"
        for section, key, value in overrides:
            if (section, key) == ("model", "name"):
                name, where = value, _COMMAND_LINE
        if name in ABSENT_MODELS:
            raise TitanliteError(
                f"model.name: {name!r} {where} is a torchtitan model family titanlite does not have; "
                f"torchtitan's {', '.join(SHARED_MODELS[:-1])} and {SHARED_MODELS[-1]} files run here"
            )

    def finish(self, cfg: JobConfig, overridden: set[tuple[str, str]]) -> None:
        """Checks that need the whole config: a file's downloaded dataset is refused unless a
        command-line override replaced it, and for validation only when validation is on; a
        torchtitan file's flavor is torchtitan's; its converter names are ours."""
        cfg.model.converters = ["float8" if n == ".".join(FLOAT8_SECTION) else n for n in cfg.model.converters]
        if self._file is not None:
            self._as_torchtitan(cfg, _COMMAND_LINE if ("model", "flavor") in overridden else self._file)
        for section, (dataset, where) in self._downloaded.items():
            if (section, "dataset") in overridden and where != _COMMAND_LINE:
                self.notices.append(
                    f"{section}.dataset = {dataset!r} {where}: torchtitan's download, replaced by the command line's"
                )
            elif section == "training" or cfg.validation.enable:
                raise _downloaded_error(section, dataset)
            else:
                self.notices.append(
                    f"validation.dataset = {dataset!r}: torchtitan's download, not used while validation is off"
                )

    def _as_torchtitan(self, cfg: JobConfig, flavor_where: str) -> None:
        """A torchtitan file trains as torchtitan does: one weight decay for every parameter
        (torchtitan has no parameter groups), not titanlite's default that exempts embeddings,
        norms and biases, unless the file or the command line names groups. And it names
        torchtitan's flavors (a command-line flavor speaks the file's names too): its flavors of
        the families titanlite has are registered under FLAVOR_PREFIX."""
        if not self._groups_given:
            cfg.optimizer.param_groups = []
            self.notices.append(
                f"optimizer.param_groups = [] {self._file}: torchtitan decays every parameter alike "
                "(titanlite's default exempts embeddings, norms and biases; set optimizer.param_groups to use it)"
            )
        if cfg.model.name in UNMAPPED_MODELS:
            raise TitanliteError(
                f"model.name: {cfg.model.name!r} {self._file} is a torchtitan file of a family whose torchtitan "
                f"flavors titanlite does not have; titanlite's own {cfg.model.name} flavors run from its own files"
            )
        flavor = cfg.model.flavor
        if cfg.model.name in SHARED_MODELS and not flavor.startswith(FLAVOR_PREFIX):
            cfg.model.flavor = FLAVOR_PREFIX + flavor
            self.notices.append(
                f"model.flavor = {flavor!r} {flavor_where}: the file is torchtitan's, so torchtitan's {flavor} shape "
                f"({cfg.model.flavor}; titanlite's own flavors are for titanlite's files)"
            )
