"""titanlite/config/sections.py: every field of every section has one line of help and a type the
engine reads, and default lists are not shared between configs."""

from __future__ import annotations

import dataclasses
import typing

from titanlite.config import JobConfig
from titanlite.config.engine import expected, sections


def test_default_lists_are_not_shared():
    a, b = JobConfig(), JobConfig()
    a.parallelism.fsdp_shard_modules.append("Block")
    assert b.parallelism.fsdp_shard_modules == []


def test_every_field_has_one_line_of_help():
    for cls in sections(JobConfig).values():
        for field in dataclasses.fields(cls):
            assert field.metadata["help"] and "\n" not in field.metadata["help"], field.name


def test_every_field_type_is_supported():
    for cls in sections(JobConfig).values():
        for name, tp in typing.get_type_hints(cls).items():
            assert expected(tp), name
