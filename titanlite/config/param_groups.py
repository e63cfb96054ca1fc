"""`optimizer.param_groups`: which parameters train with which lr scale and weight decay.

Each entry is one string, `"PATTERN [PATTERN ...]: key=value [key=value]"`: shell-style
patterns (`fnmatch.fnmatchcase`, where `*` also crosses dots) matched against the whole
parameter name as the model names it (`layers.0.attention.wq.weight`; wrappers' prefixes
never appear), then the group's settings, `lr_scale` (times the optimizer's lr) and
`weight_decay`; a key left out keeps the optimizer's value. A parameter joins the first
entry with a matching pattern; a parameter no entry matches trains with `optimizer.lr` and
`optimizer.weight_decay`.

The pattern `@no_decay` stands for the model's own no-decay patterns (`ModelSpec.no_decay`, which
each model declares: the shared decoder's `tok_embeddings.* *norm.weight`, GPT-2's
`embeddings.* *ln_*.weight *.bias`); step/optim.py puts them in its place when the optimizer is
built, and names the group by them. The default, `"@no_decay: weight_decay=0.0"`, exempts every
model's embeddings, norms and biases from weight decay (as OLMo 2 its embeddings, GPT-3 and
Megatron-LM norms and biases); the output head decays like every other matrix.

A string per entry keeps the option a plain list, the same in a TOML file and on the command
line (`--optimizer.param_groups '["output.*: lr_scale=0.5"]'`). No torch here: the config is
checked before torch is imported.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from dataclasses import dataclass

from titanlite.errors import TitanliteError

FIELD = "optimizer.param_groups"
NO_DECAY = "@no_decay"
DEFAULT_GROUPS = (f"{NO_DECAY}: weight_decay=0.0",)
_KEYS = ("lr_scale", "weight_decay")


@dataclass(frozen=True)
class GroupSpec:
    """One parameter group's rule: the name patterns it takes and its settings (None: the
    optimizer's own). `text` is the entry as written, the group's name in checkpoints."""

    patterns: tuple[str, ...]
    lr_scale: float | None
    weight_decay: float | None
    text: str

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)


def parse_groups(entries: list[str], no_decay: tuple[str, ...] = ()) -> list[GroupSpec]:
    """Every entry parsed, `@no_decay` replaced by `no_decay` (the model's patterns; the config's
    own check knows no model); TitanliteError naming the field, the entry and what is wrong."""
    return [_parse(entry, no_decay) for entry in entries]


def _parse(entry: str, no_decay: tuple[str, ...]) -> GroupSpec:
    def bad(why: str) -> TitanliteError:
        return TitanliteError(f"{FIELD}: entry {entry!r} {why} (expected 'PATTERN [PATTERN ...]: key=value ...')")

    head, colon, tail = entry.partition(":")
    patterns = tuple(head.split())
    if not colon:
        raise bad("has no ':' between its patterns and its settings")
    if not patterns:
        raise bad("names no pattern")
    if named := [pattern for pattern in patterns if pattern.startswith("@") and pattern != NO_DECAY]:
        raise bad(f"has {named[0]!r}: the one named pattern is {NO_DECAY}, the model's no-decay parameters")
    settings: dict[str, float] = {}
    for item in tail.split():
        key, equals, text = item.partition("=")
        if not equals or key not in _KEYS:
            raise bad(f"has {item!r}: settings are {' and '.join(f'{k}=NUMBER' for k in _KEYS)}")
        if key in settings:
            raise bad(f"sets {key} twice")
        try:
            value = float(text)
        except ValueError:
            raise bad(f"has {key}={text!r}, not a number") from None
        if not math.isfinite(value) or value < 0:
            raise bad(f"has {key}={text}: must be a finite number >= 0")
        settings[key] = value
    if not settings:
        raise bad("sets neither lr_scale nor weight_decay")
    expanded = tuple(each for pattern in patterns for each in (no_decay if pattern == NO_DECAY else (pattern,)))
    return GroupSpec(expanded, settings.get("lr_scale"), settings.get("weight_decay"), entry.strip())


def check_matched(entries: list[str], names: list[str]) -> None:
    """Every pattern an entry names matches one of `names`, the whole model's parameter names (not
    one pipeline stage's), checked when the run is planned: a typo would otherwise train under the
    optimizer's settings without a word. `@no_decay`, the model's own patterns, is not checked."""
    for spec in parse_groups(entries):  # no no_decay patterns given: @no_decay stands for none here
        for pattern in (pattern for pattern in spec.patterns if not fnmatch.filter(names, pattern)):
            closest = difflib.get_close_matches(pattern, names, n=1, cutoff=0.0)
            raise TitanliteError(
                f"{FIELD}: entry {spec.text!r} has {pattern!r}, which matches no parameter (closest: {closest[0]!r})"
            )


def group_of(name: str, groups: list[GroupSpec]) -> GroupSpec | None:
    """The first group whose patterns match `name`, or None (the optimizer's own settings)."""
    return next((group for group in groups if group.matches(name)), None)
