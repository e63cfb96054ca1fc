"""The config written out: help text, plain dicts and TOML, derived from the same field
metadata the engine checks values with (`titanlite.config.engine`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from titanlite.config.engine import keys, range_text, sections, shown_choice, toml_value, type_name


def help_lines(root: type) -> list[str]:
    """For each section a blank line and `[section]  doc`, then per key two lines:
    `  --section.key  type-or-choices = default  (range)` and `      help`."""
    lines: list[str] = []
    for section, section_cls in sections(root).items():
        lines += ["", f"[{section}]  {(section_cls.__doc__ or '').strip()}"]
        for key, (tp, f) in keys(section_cls).items():
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            kind = "|".join(map(shown_choice, f.metadata["choices"])) if f.metadata["choices"] else type_name(tp)
            rule = range_text(f.metadata)
            lines.append(f"  --{section}.{key}  {kind} = {toml_value(default)}{f'  ({rule})' if rule else ''}")
            lines.append(f"      {f.metadata['help']}")
    return lines


def to_dict(cfg: Any) -> dict[str, dict[str, Any]]:
    """The config as nested plain dicts (section -> key -> value), for logs and saved state."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: Any) -> str:
    """The config as TOML text that `apply_toml` reads back to an equal config."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines += [f"[{section}]"] + [f"{key} = {toml_value(value)}" for key, value in values.items()] + [""]
    return "\n".join(lines)
