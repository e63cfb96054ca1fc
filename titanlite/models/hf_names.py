"""A model's Hugging Face names, both ways, from one table of patterns (used by each model's
hf_adapter.py): `{i}` in a name stands for a layer number, which the rename carries over."""

from __future__ import annotations

import re


def _compile(table: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile("^" + re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"), dst) for src, dst in table.items()]


class NameTable:
    """Our state-dict key <-> its Hugging Face name, for every pattern of `ours_to_hf`."""

    def __init__(self, ours_to_hf: dict[str, str]):
        self._to_hf = _compile(ours_to_hf)
        self._from_hf = _compile({hf: ours for ours, hf in ours_to_hf.items()})

    def to_hf(self, key: str) -> str:
        """Our key -> its HF name (KeyError for a key the table has no pattern for)."""
        return _rename(key, self._to_hf)

    def from_hf(self, name: str) -> str:
        """An HF name -> our key (KeyError for a name the table has no pattern for)."""
        return _rename(name, self._from_hf)


def _rename(key: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, target in rules:
        match = pattern.match(key)
        if match:
            return target.replace("{i}", match.group(1)) if match.groups() else target
    raise KeyError(key)
