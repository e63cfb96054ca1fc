"""torchtitan's own TOML files, read as they are: its names for titanlite's options, and its
options titanlite does not have.

- Aliases, one home each: `checkpoint.enable` is `checkpoint.enable_checkpoint`,
  `checkpoint.last_save_model_only` is `checkpoint.model_weights_only`, `lr_scheduler.min_lr_factor`
  is `lr_scheduler.lr_min`. (`model.hf_assets_path` and the string forms of
  `activation_checkpoint.selective_ac_option` are options of their own, in sections.py.)
- Options titanlite does not have are accepted with one notice when set to what they are off
  (or to no effect), and refused in one line when they would change the run:
  `parallelism.enable_async_tensor_parallel`, a `[quantize]` section that enables nothing;
  `metrics.disable_color_printing` and `compile.components` have no effect to have (titanlite
  prints no colors; `compile.enable` compiles every block).
- Datasets torchtitan downloads (`c4`, `c4_test`, `c4_validation`) are refused with the line
  that says how to prepare one locally, unless a command-line override names another
  dataset (overrides win, as everywhere); a validation dataset of that kind is only a
  notice while validation is off.
- `model.converters` (torchtitan's float8 / mx model conversions) is refused in one line
  when it names one; an empty list is a notice.
- A file that names any of the keys above is torchtitan's, and its flavor names are torchtitan's:
  for the model families titanlite has (llama3, qwen3) `model.flavor = "debugmodel"` becomes
  `torchtitan:debugmodel`, torchtitan v0.2.2's shape (models/<family>/__init__.py), with a
  notice, so the file trains what it trains under torchtitan; titanlite's own, faster debug
  flavors stay for titanlite's files (deepseek_v3's flavors are titanlite's own, no torchtitan
  shapes). A family titanlite does not have (llama4, gpt_oss, ...) is refused by name before
  any key of its file is read: those keys would otherwise be the first error, and a misleading one.
- `model.num_nextn_predict_layers` (DeepSeek-V3's multi-token prediction) is refused unless 0.

Notices are collected (`TorchtitanKeys.notices`); the command lines print them once, rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from titanlite.config.engine import parse_list
from titanlite.errors import TitanliteError

if TYPE_CHECKING:
    from titanlite.config.engine import Override
    from titanlite.config.sections import JobConfig

ALIASES = {
    ("checkpoint", "enable"): "enable_checkpoint",
    ("checkpoint", "last_save_model_only"): "model_weights_only",
    ("lr_scheduler", "min_lr_factor"): "lr_min",
}
# (section, key): (the value that leaves it off, what titanlite does instead)
OFF_ONLY = {
    ("parallelism", "enable_async_tensor_parallel"): (False, "titanlite has no async tensor parallelism"),
    ("parallelism", "expert_tensor_parallel_degree"): (
        1,
        "titanlite has no expert tensor parallelism: the experts are split by expert_parallel_degree, never by tp",
    ),
    # DeepSeek-V3's config name for its multi-token prediction modules.
    ("model", "num_nextn_predict_layers"): (0, "titanlite has no multi-token prediction (DeepSeek-V3's MTP)"),
}
NO_EFFECT = {
    ("metrics", "disable_color_printing"): "titanlite prints no colors",
    ("compile", "components"): "compile.enable compiles each transformer block; the loss runs eager",
}
DOWNLOADED_DATASETS = ("c4", "c4_test", "c4_validation")
# torchtitan v0.2.2's model families (torchtitan/models/__init__.py): those titanlite has, whose
# torchtitan flavors are registered as FLAVOR_PREFIX + name, and those it does not have.
SHARED_MODELS = ("llama3", "qwen3")
ABSENT_MODELS = ("flux", "gpt_oss", "llama3_ft", "llama4")
FLAVOR_PREFIX = "torchtitan:"
_COMMAND_LINE = "on the command line"  # the `where` of an override (config/engine.py)
_PREPARE = (
    "titanlite reads local data prepared once into token shards: python -m titanlite.data.prepare "
    'hf:allenai/c4:en prepared/ --tokenizer TOKENIZER (pip install titanlite[hf]), then dataset = "prepared" '
    'and dataset_path = "prepared/" (docs/data.md)'
)


def _is_on(value: Any) -> bool:
    """A TOML value, or an override's text, that switches something on."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value) and value is not False


def _listed(text: str) -> list[str]:
    """A list option's text (`float8`, `float8,mx`, `["float8"]`) as its names; text that
    does not parse as a list is one name."""
    try:
        return parse_list(text)
    except ValueError:
        return [text]


def _is_off(value: Any, off: bool | int) -> bool:
    """Whether a TOML value, or an override's text, is an option's off value (a boolean or a number)."""
    if isinstance(off, bool):
        return _is_on(value) == off
    return not isinstance(value, bool) and str(value).strip() == str(off)


def _torchtitans(section: str, key: str | None, value: Any) -> bool:
    """Whether a key is one only torchtitan's files name (key None: a section of theirs)."""
    return (
        key is None
        or any((section, key) in table for table in (ALIASES, OFF_ONLY, NO_EFFECT))
        or (section, key) == ("model", "converters")
        or (key == "dataset" and value in DOWNLOADED_DATASETS)
    )


def _enables(table: Any) -> list[str]:
    """The enable* keys set on anywhere in a (nested) table."""
    if not isinstance(table, dict):
        return []
    found = []
    for key, value in table.items():
        if isinstance(value, dict):
            found += [f"{key}.{inner}" for inner in _enables(value)]
        elif key.startswith("enable") and _is_on(value):
            found.append(key)
    return found


class TorchtitanKeys:
    """The translation `config.engine` applies to each key before looking it up."""

    def __init__(self) -> None:
        self.notices: list[str] = []
        self._downloaded: dict[str, tuple[str, str]] = {}  # section -> (dataset, where) from a file, decided in finish
        self._file: str | None = None  # the `where` of a file read as torchtitan's

    def __call__(self, section: str, key: str | None, value: Any, where: str) -> tuple[str, str, Any] | None:
        """The (section, key, value) to set, or None when this key is handled here."""
        if where != _COMMAND_LINE and _torchtitans(section, key, value):
            self._file = where
        if key is None:  # a whole section titanlite does not have
            return self._section(section, value, where)
        if (section, key) in ALIASES:
            return section, ALIASES[(section, key)], value
        if (
            (section, key) == ("activation_checkpoint", "selective_ac_option")
            and isinstance(value, int)
            and not isinstance(value, bool)
        ):
            return section, key, str(value)  # the number form of the string option ('2' in torchtitan's files)
        if (section, key) in OFF_ONLY:
            off, instead = OFF_ONLY[(section, key)]
            if not _is_off(value, off):
                raise TitanliteError(
                    f"{section}.{key}: not supported ({instead}); set it to {str(off).lower()} or leave it out"
                )
            self.notices.append(f"{section}.{key} = {str(off).lower()} {where}: torchtitan's option, off; {instead}")
            return None
        if (section, key) in NO_EFFECT:
            self.notices.append(
                f"{section}.{key} {where}: torchtitan's option, no effect here: {NO_EFFECT[(section, key)]}"
            )
            return None
        if key == "dataset" and section in ("training", "validation") and value in DOWNLOADED_DATASETS:
            if section == "training" and where == _COMMAND_LINE:
                raise TitanliteError(
                    f"training.dataset: {value!r} is a dataset torchtitan downloads at run time; {_PREPARE}"
                )
            self._downloaded[section] = (value, where)
            return None
        if (section, key) == ("model", "converters"):
            value = value if isinstance(value, list) else _listed(str(value))  # the command line's text
            if value:
                raise TitanliteError(
                    f"model.converters: {', '.join(map(str, value))} is not supported (titanlite has no "
                    "float8 or mx conversion); remove it or leave the list empty"
                )
            self.notices.append(
                f"model.converters = [] {where}: torchtitan's option, no conversion; titanlite has none"
            )
            return None
        return section, key, value

    def _section(self, section: str, table: Any, where: str) -> None:
        enabled = _enables(table)
        if enabled:
            raise TitanliteError(
                f"[quantize] {where}: {', '.join(enabled)} is not supported (titanlite has no float8 or "
                "mx quantization); remove the section"
            )
        self.notices.append(
            f"[quantize] {where}: torchtitan's quantization section, nothing enabled; titanlite has none"
        )
        return None

    def refuse_absent_model(self, data: dict[str, Any], shown: str, overrides: Sequence[Override]) -> None:
        """Before a file's keys are read: its model, or the command line's, is not a torchtitan
        family titanlite lacks (whose files name options of that family, such as
        expert_tensor_parallel_degree, that would otherwise be the first error)."""
        model = data.get("model")
        name, where = (model.get("name") if isinstance(model, dict) else None), f"in {shown}"
        for section, key, value in overrides:
            if (section, key) == ("model", "name"):
                name, where = value, _COMMAND_LINE
        if name in ABSENT_MODELS:
            raise TitanliteError(
                f"model.name: {name!r} {where} is a torchtitan model family titanlite does not have; "
                f"torchtitan's {' and '.join(SHARED_MODELS)} files run here"
            )

    def finish(self, cfg: JobConfig, overridden: set[tuple[str, str]]) -> None:
        """Checks that need the whole config: a file's downloaded dataset is refused unless a
        command-line override replaced it, and for validation only when validation is on; a
        torchtitan file's flavor is torchtitan's."""
        self._torchtitan_flavor(cfg, _COMMAND_LINE if ("model", "flavor") in overridden else self._file)
        for section, (dataset, where) in self._downloaded.items():
            if (section, "dataset") in overridden and where != _COMMAND_LINE:
                self.notices.append(
                    f"{section}.dataset = {dataset!r} {where}: torchtitan's download, replaced by the command line's"
                )
            elif section == "training" or cfg.validation.enable:
                raise TitanliteError(
                    f"{section}.dataset: {dataset!r} is a dataset torchtitan downloads at run time; {_PREPARE}"
                )
            else:
                self.notices.append(
                    f"validation.dataset = {dataset!r}: torchtitan's download, not used while validation is off"
                )

    def _torchtitan_flavor(self, cfg: JobConfig, where: str | None) -> None:
        """A torchtitan file names torchtitan's flavors (a command-line flavor speaks the file's
        names too): its llama3 and qwen3 flavors are registered under FLAVOR_PREFIX."""
        flavor = cfg.model.flavor
        if self._file is None or cfg.model.name not in SHARED_MODELS or flavor.startswith(FLAVOR_PREFIX):
            return
        cfg.model.flavor = FLAVOR_PREFIX + flavor
        self.notices.append(
            f"model.flavor = {flavor!r} {where}: the file is torchtitan's, so torchtitan's {flavor} shape "
            f"({cfg.model.flavor}; titanlite's own flavors are for titanlite's files)"
        )

    def handles_section(self, section: str) -> bool:
        """A section titanlite does not have but torchtitan's files carry."""
        return section == "quantize"
