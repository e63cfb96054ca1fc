"""The generic machinery behind a config made of dataclasses, kept apart from our options.

A *root* dataclass holds one *section* dataclass per TOML table; every section field is
declared with `option(...)`, which puts its help line and its rules (choices, range,
non-empty, one special value) into the field's metadata. From that alone this module
coerces TOML values, parses `--section.key value` overrides, suggests the closest name for
a misspelt or misplaced key, checks every value, and writes help text and TOML.

It names no section and no key: `titanlite.config` declares the options and passes its
root class in, so the schema reads as a list of options and this engine is tested on a
made-up one. Supported field types: bool, int, float, str, list[str], and `X | None`.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from titanlite.errors import TitanliteError

Override = tuple[str, str, Any]
"""(section, key, parsed value) from the command line."""

QUOTED_LIMIT = 60  # characters of a value an error line quotes (`quoted`)


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


def _optional_inner(tp: Any) -> Any | None:
    """X for `X | None` / Optional[X], else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} | none"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def expected(tp: Any) -> str:
    """What a value of type `tp` is, in words, for error messages (KeyError if unsupported)."""
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{expected(inner)} or none"
    if typing.get_origin(tp) is list:
        return "a list of strings"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}[tp]


# --------------------------------------------------------------------------------------
# Values: TOML coercion and command-line parsing
# --------------------------------------------------------------------------------------

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


def parse_list(text: str) -> list[str]:
    """`a,b`, one name `a`, or TOML-style `["a", "b"]` as a list of strings (never a string's
    characters); ValueError if the bracketed form does not parse. Also for a list option that
    another tool's translation handles (`Translate`), whose command-line value arrives as text."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            value = tomllib.loads(f"v = {stripped}")["v"]
        except tomllib.TOMLDecodeError as error:
            raise ValueError from error
        return _coerce(value, list[str])
    return [part.strip() for part in text.split(",") if part.strip()]


def _parse_cli(text: str, tp: Any) -> Any:
    """A command-line string parsed as `tp`; ValueError if it does not parse."""
    inner = _optional_inner(tp)
    if inner is not None:
        return None if text.strip().lower() == "none" else _parse_cli(text, inner)
    if typing.get_origin(tp) is list:
        return parse_list(text)
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


# --------------------------------------------------------------------------------------
# Names: lookup with the closest valid name suggested
# --------------------------------------------------------------------------------------


def _closest(name: str, candidates: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def _hint(suggestion: str | None) -> str:
    return f"; did you mean {suggestion}?" if suggestion else ""


def suggest_key(root: type, section: str, key: str) -> str | None:
    """The valid `section.key` closest to a misspelt or misplaced one (None if nothing is close)."""
    by_name = sections(root)
    if section in by_name and (close := _closest(key, list(keys(by_name[section])))):
        return f"{section}.{close}"
    homes = [s for s, cls in by_name.items() if key in keys(cls)]
    if homes:  # a right key in a wrong or missing section
        best = difflib.get_close_matches(section, homes, n=1, cutoff=0.0) if section else homes
        return f"{best[0]}.{key}"
    if section in by_name:
        return None
    everything = [f"{s}.{k}" for s, cls in by_name.items() for k in keys(cls)]
    return _closest(f"{section}.{key}" if section else key, everything)


def _lookup(root: type, section: str, key: str, where: str) -> tuple[Any, dataclasses.Field]:
    """The (type, field) of `section.key`, or a TitanliteError naming it and the closest name."""
    by_name = sections(root)
    found = keys(by_name[section]) if section in by_name else {}
    if key not in found:
        shown = f"{section}.{key}" if section else key
        raise TitanliteError(f"unknown key {shown} {where}{_hint(suggest_key(root, section, key))}")
    return found[key]


# --------------------------------------------------------------------------------------
# Input: TOML files and the command line
# --------------------------------------------------------------------------------------


class Translate(Protocol):
    """Maps a key before it is looked up: (section, key, value, where) -> the (section, key,
    value) to set, or None when it handled the key itself. Key None: a whole section the
    config does not have, which `handles_section` claims; then the (section, key, value)
    triples to set in the config's own sections (or None)."""

    def __call__(self, section: str, key: str | None, value: Any, where: str) -> Any: ...

    def handles_section(self, section: str) -> bool: ...


def read_toml(path: Path, shown: str) -> dict[str, Any]:
    """A TOML file parsed, or a one-line TitanliteError naming it as `shown`. A file that
    sets nothing is an error too: a config that was meant to say something (a truncated
    copy, the wrong file) must not train on the defaults without a word."""
    try:
        with open(path, "rb") as f:
            data = tomllib.loads(f.read().decode("utf-8-sig"))  # a byte-order mark (Windows editors) is not TOML
    except tomllib.TOMLDecodeError as error:
        message = " ".join(str(error).split())
        raise TitanliteError(f"invalid TOML in {shown}: {message}") from None
    except UnicodeDecodeError:
        raise TitanliteError(f"invalid TOML in {shown}: the file is not UTF-8 text") from None
    except OSError as error:
        raise TitanliteError(f"cannot read config file {shown}: {error.strerror}") from None
    if not data:
        raise TitanliteError(
            f"config file {shown} is empty (it sets no [section] key); leave out --config for the defaults"
        )
    return data


def apply_toml(cfg: Any, data: dict[str, Any], shown: str, translate: Translate | None = None) -> None:
    """Set every `[section] key = value` of a parsed TOML file on `cfg`, checking names and
    types; `translate` first maps each key (another tool's names, see `Translate`)."""
    root, where = type(cfg), f"in {shown}"
    by_name = sections(root)
    for section, table in data.items():
        if not isinstance(table, dict):
            if section in by_name:
                raise TitanliteError(
                    f"{section} {where} is a section, not a key: write [{section}] and its keys under it"
                )
            raise TitanliteError(
                f"unknown key {section} {where} (keys belong in a [section]){_hint(suggest_key(root, '', section))}"
            )
        if section not in by_name:
            if translate is not None and translate.handles_section(section):
                for own_section, key, value in translate(section, None, table, where) or ():
                    _set(cfg, own_section, key, value, where)
                continue
            close = _closest(section, list(by_name))
            raise TitanliteError(f"unknown section [{section}] {where}{_hint(f'[{close}]' if close else None)}")
        for given_key, given_value in table.items():
            mapped = (
                translate(section, given_key, given_value, where)
                if translate is not None
                else (section, given_key, given_value)
            )
            if mapped is not None:
                _set(cfg, section, mapped[1], mapped[2], where)


def _set(cfg: Any, section: str, key: str, value: Any, where: str) -> None:
    """One TOML value set on `cfg`, its name and type checked."""
    tp, _ = _lookup(type(cfg), section, key, where)
    try:
        setattr(getattr(cfg, section), key, _coerce(value, tp))
    except ValueError:
        raise TitanliteError(f"{section}.{key}: expected {expected(tp)}, got {quoted(value)} {where}") from None


def cli_pairs(argv: Sequence[str], usage: str) -> Iterator[tuple[str, str | None]]:
    """`(name, value)` for each `--name value`, `--name=value` or bare `--name` (value None), in order.

    A bare option is one followed by nothing or by another `--option`. Anything else that
    does not start with `--` is an error naming `usage` (the accepted forms, in words).
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            raise TitanliteError(f"unexpected argument {arg!r}; options are {usage}")
        name, has_value, value = arg[2:].partition("=")
        if not has_value and i < len(argv) and not argv[i].startswith("--"):
            value, has_value, i = argv[i], "=", i + 1
        yield name, value if has_value else None


def parse_override(root: type, name: str, value: str | None, translate: Translate | None = None) -> Override | None:
    """`--section.key value` parsed by the field's type; a bare boolean flag means true.
    None: `translate` handled the key (it has nothing to set)."""
    section, _, key = name.rpartition(".")
    if translate is not None and (section, key) != ("", name):
        mapped = translate(section, key, "true" if value is None else value, "on the command line")
        if mapped is None:
            return None
        section, key, _ = mapped
        name = f"{section}.{key}"
    tp, _ = _lookup(root, section, key, "on the command line")
    if value is None:
        if tp is not bool:
            raise TitanliteError(f"{section}.{key}: --{name} needs a value ({expected(tp)})")
        value = "true"  # a bare --section.flag switches it on
    try:
        return section, key, _parse_cli(value, tp)
    except ValueError:
        raise TitanliteError(f"{section}.{key}: expected {expected(tp)}, got {quoted(value)}") from None


def refuse_repeats(overrides: Sequence[Override]) -> None:
    """A key set twice on one command line is an error, as a repeated `--config` is: which
    of the two the user meant is a guess (a script appending to a command line, a typo)."""
    seen: dict[tuple[str, str], Any] = {}
    for section, key, value in overrides:
        if (section, key) in seen:
            raise TitanliteError(
                f"--{section}.{key} given twice ({toml_value(seen[section, key])} and {toml_value(value)})"
            )
        seen[section, key] = value


# --------------------------------------------------------------------------------------
# Checks: type, finiteness, choices, non-empty and range of every value
# --------------------------------------------------------------------------------------


def range_text(meta: typing.Mapping[str, Any]) -> str:
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


def _in_range(value: Any, meta: typing.Mapping[str, Any]) -> bool:
    if "special" in meta and value == meta["special"] and type(value) is type(meta["special"]):
        return True
    if value is None:
        return False
    bounds = (
        (meta["gt"], operator.gt),
        (meta["ge"], operator.ge),
        (meta["lt"], operator.lt),
        (meta["le"], operator.le),
    )
    return all(bound is None or compare(value, bound) for bound, compare in bounds)


def _check_field(name: str, tp: Any, meta: typing.Mapping[str, Any], value: Any) -> None:
    """Type, finiteness, choices and range of one value, from its field's metadata."""
    if not _is_type(value, tp):
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
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def quoted(value: Any, limit: int = QUOTED_LIMIT) -> str:
    """A value as an error line quotes it: its repr, cut to `limit` characters, so that a pasted
    file or a 10,000-digit number still leaves one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text):,} characters)"


def shown_choice(choice: str) -> str:
    """A choice as a message shows it: the empty string as "" (a bare comma reads as nothing)."""
    return choice if choice else '""'
