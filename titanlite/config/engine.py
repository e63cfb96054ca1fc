"""The generic machinery behind a config made of dataclasses, kept apart from our options.

A *root* dataclass holds one *section* dataclass per TOML table; every section field is
declared with `option(...)`, which puts its help line and its rules (choices, range,
non-empty, one special value) into the field's metadata. From that alone this module
describes each field's type in words and checks every value; `parse.py` reads TOML files and
`--section.key value` overrides into a config (suggesting the closest name for a misspelt or
misplaced key), and `output.py` writes help text and TOML.

It names no section and no key: `titanlite.config` declares the options and passes its
root class in, so the schema reads as a list of options and this engine is tested on a
made-up one. Supported field types: bool, int, float, str, list[str], and `X | None`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import types
import typing
from collections.abc import Sequence
from typing import Any

from titanlite.errors import TitanliteError

QUOTED_LIMIT = 60  # characters of a value an error line quotes (`quoted`)
# A range rule: how a message writes it, and the test a value must pass.
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


def option(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] = (),
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    special: Any = dataclasses.MISSING,
    nonempty: bool = False,
) -> Any:
    """A config field: its default, one line of help, and the rules `check_values` checks.

    `special` is one extra allowed value outside the range (a -1 or None sentinel).
    """
    rules = {"help": help, "choices": tuple(choices), "gt": gt, "ge": ge, "lt": lt, "le": le, "nonempty": nonempty}
    if special is not dataclasses.MISSING:
        rules["special"] = special
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=rules)
    return dataclasses.field(default=default, metadata=rules)


# --------------------------------------------------------------------------------------
# Introspection
# --------------------------------------------------------------------------------------


@functools.cache
def sections(root: type) -> dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    hints = typing.get_type_hints(root)
    return {f.name: hints[f.name] for f in dataclasses.fields(root)}


@functools.cache
def keys(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    """Key name -> (resolved type hint, dataclass field) for one section."""
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def optional_inner(tp: Any) -> Any | None:
    """X for `X | None` / Optional[X], else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_name(tp: Any) -> str:
    if (inner := optional_inner(tp)) is not None:
        return f"{type_name(inner)} | none"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def expected(tp: Any) -> str:
    """What a value of type `tp` is, in words, for error messages (KeyError if unsupported)."""
    if (inner := optional_inner(tp)) is not None:
        return f"{expected(inner)} or none"
    if typing.get_origin(tp) is list:
        return "a list of strings"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}[tp]


def is_type(value: Any, tp: Any) -> bool:
    """Whether `value` is a valid Python value for a field typed `tp` (ints count as floats)."""
    if (inner := optional_inner(tp)) is not None:
        return value is None or is_type(value, inner)
    if typing.get_origin(tp) is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if tp in (int, float):
        return isinstance(value, (int, tp)) and not isinstance(value, bool)
    return isinstance(value, tp)


# --------------------------------------------------------------------------------------
# Checks: type, finiteness, choices, non-empty and range of every value
# --------------------------------------------------------------------------------------


def range_text(meta: typing.Mapping[str, Any]) -> str:
    """What a field's range rules require, in words ('> 0', '-1 or >= 1'), or '' when it has none."""
    lo = next((rule for rule in ("ge", "gt") if meta[rule] is not None), None)
    hi = next((rule for rule in ("le", "lt") if meta[rule] is not None), None)
    if lo and hi:
        text = f"in {'[' if lo == 'ge' else '('}{meta[lo]:g}, {meta[hi]:g}{']' if hi == 'le' else ')'}"
    elif lo or hi:
        text = f"{_BOUNDS[lo or hi][0]} {meta[lo or hi]:g}"
    else:
        return ""
    if "special" in meta:
        special = "none" if meta["special"] is None else meta["special"]
        return f"{special} or {text}"
    return text


def _in_range(value: Any, meta: typing.Mapping[str, Any]) -> bool:
    if "special" in meta and value == meta["special"] and type(value) is type(meta["special"]):
        return True
    return value is not None and all(
        meta[rule] is None or test(value, meta[rule]) for rule, (_, test) in _BOUNDS.items()
    )


def _check_field(name: str, tp: Any, meta: typing.Mapping[str, Any], value: Any) -> None:
    """Type, finiteness, choices and range of one value, from its field's metadata."""
    if not is_type(value, tp):
        raise TitanliteError(f"{name}: expected {expected(tp)} (got {quoted(value)})")
    if isinstance(value, float) and not math.isfinite(value):
        raise TitanliteError(f"{name}: must be a finite number (got {quoted(value)})")
    if meta["choices"] and value not in meta["choices"]:
        raise TitanliteError(
            f"{name}: must be one of {', '.join(map(shown_choice, meta['choices']))} (got {quoted(value)})"
        )
    if meta["nonempty"] and not value:
        raise TitanliteError(f"{name}: must not be empty (got {quoted(value)})")
    rule = range_text(meta)
    if rule and not _in_range(value, meta):
        raise TitanliteError(f"{name}: must be {rule} (got {quoted(value)})")


def check_values(cfg: Any) -> None:
    """Raise TitanliteError on the first value (sections and keys in declaration order) that
    breaks its field's type or rules; combinations of values are the schema's to check."""
    for section, section_cls in sections(type(cfg)).items():
        values = getattr(cfg, section)
        if not isinstance(values, section_cls):
            raise TitanliteError(f"{section}: expected a [{section}] section (got {quoted(values)})")
        for key, (tp, f) in keys(section_cls).items():
            _check_field(f"{section}.{key}", tp, f.metadata, getattr(values, key))


def toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, float):
        return repr(value)  # TOML's inf and nan, which JSON spells otherwise
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)  # booleans, integers and strings as TOML writes them


def quoted(value: Any, limit: int = QUOTED_LIMIT) -> str:
    """A value as an error line quotes it: its repr, cut to `limit` characters, so that a pasted
    file or a 10,000-digit number still leaves one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text):,} characters)"


def shown_choice(choice: str) -> str:
    """A choice as a message shows it: the empty string as "" (a bare comma reads as nothing)."""
    return choice if choice else '""'
