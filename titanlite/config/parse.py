"""Reading a config: TOML files and `--section.key value` command lines parsed into the root
dataclass, each key looked up by name (the closest valid name suggested when it is misspelt
or misplaced) and each value by its field's type. Part of the generic engine (`engine.py`
declares the fields and checks their values): it names no section either.
"""

from __future__ import annotations

import difflib
import sys
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from titanlite.config.engine import expected, is_type, keys, optional_inner, quoted, sections, toml_value
from titanlite.errors import TitanliteError

Override = tuple[str, str, Any]
"""(section, key, parsed value) from the command line."""

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def _coerce(value: Any, tp: Any) -> Any:
    """A TOML value checked against `tp` (ints widened to float); ValueError if it is the wrong type."""
    if optional_inner(tp) is not None and isinstance(value, str) and value.strip().lower() == "none":
        return None  # TOML has no null; files and the CLI spell it "none"
    if not is_type(value, tp):
        raise ValueError
    if isinstance(value, list):
        return list(value)
    return float(value) if isinstance(value, int) and float in (tp, optional_inner(tp)) else value


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
    if (inner := optional_inner(tp)) is not None:
        return None if text.strip().lower() == "none" else _parse_cli(text, inner)
    if typing.get_origin(tp) is list:
        return parse_list(text)
    if tp is bool:
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError
    return tp(text)  # int, float or str


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
    if homes := [s for s, cls in by_name.items() if key in keys(cls)]:  # a right key in a wrong or missing section
        best = difflib.get_close_matches(section, homes, n=1, cutoff=0.0) if section else homes
        return f"{best[0]}.{key}"
    if section in by_name:
        return None
    everything = [f"{s}.{k}" for s, cls in by_name.items() for k in keys(cls)]
    return _closest(f"{section}.{key}" if section else key, everything)


def _lookup(root: type, section: str, key: str, where: str) -> Any:
    """The type of `section.key`, or a TitanliteError naming it and the closest name."""
    by_name = sections(root)
    found = keys(by_name[section]) if section in by_name else {}
    if key not in found:
        shown = f"{section}.{key}" if section else key
        raise TitanliteError(f"unknown key {shown} {where}{_hint(suggest_key(root, section, key))}")
    return found[key][0]


# --------------------------------------------------------------------------------------
# Input: TOML files and the command line
# --------------------------------------------------------------------------------------


class Translate(Protocol):
    """Maps a key before it is looked up: (section, key, value, where) -> the (section, key,
    value) to set, or None when it handled the key itself. Key None: a whole section the
    config does not have; then the (section, key, value) triples to set in the config's own
    sections, or None when the section is not one it knows either."""

    def __call__(self, section: str, key: str | None, value: Any, where: str) -> Any: ...


def read_toml(path: Path, shown: str) -> dict[str, Any]:
    """A TOML file parsed, or a one-line TitanliteError naming it as `shown`. A file that
    sets nothing is an error too: a config that was meant to say something (a truncated
    copy, the wrong file) must not train on the defaults without a word."""
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8-sig"))  # a byte-order mark (Windows editors) is not TOML
    except tomllib.TOMLDecodeError as error:
        raise TitanliteError(f"invalid TOML in {shown}: {' '.join(str(error).split())}") from None
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
            triples = translate(section, None, table, where) if translate is not None else None
            if triples is None:
                close = _closest(section, list(by_name))
                raise TitanliteError(f"unknown section [{section}] {where}{_hint(f'[{close}]' if close else None)}")
            for own_section, key, value in triples:
                _set(cfg, own_section, key, value, where)
            continue
        for key, value in table.items():
            mapped = translate(section, key, value, where) if translate is not None else (section, key, value)
            if mapped is not None:
                _set(cfg, section, mapped[1], mapped[2], where)


def _set(cfg: Any, section: str, key: str, value: Any, where: str) -> None:
    """One TOML value set on `cfg`, its name and type checked."""
    tp = _lookup(type(cfg), section, key, where)
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
    tp = _lookup(root, section, key, "on the command line")
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
