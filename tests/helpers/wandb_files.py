"""Reading a W&B run that wandb wrote offline (WANDB_MODE=offline): its history and config,
from the run's `.wandb` file. wandb's Python package has no reader for it any more (its
core service writes it), so the framing is read here: LevelDB's log format (32 KiB blocks of
records, each with a 7-byte header, long ones split FIRST/MIDDLE/LAST) after a 7-byte
`:W&B` file header; each record is wandb's own protobuf `Record`, parsed by its class."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<IHB")  # masked crc32c, length, kind
FILE_HEADER = struct.Struct("<4sHB")  # ":W&B", magic, version
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


# What the environment may say about a W&B run (titanlite/observe/wandb_run.py), cleared by
# `offline_wandb` so that a test sees only what it sets.
RUN_VARIABLES = (
    "WANDB_PROJECT",
    "WANDB_TEAM",
    "WANDB_RUN_NAME",
    "WANDB_RUN_ID",
    "WANDB_RUN_NOTES",
    "WANDB_RUN_TAGS",
    "WANDB_RUN_GROUP",
    "WANDB_RUN_JOB_TYPE",
    "WANDB_RESUME_FROM",
    "WANDB_FORK_FROM",
    "WANDB_DIR",
    "WANDB_NAME",
)


def offline_wandb(monkeypatch, folder: Path) -> None:
    """W&B offline (no network, no account), its cache and settings under `folder`, and none of
    the variables that describe a run set; this process and the ones it starts."""
    for variable in RUN_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(folder / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(folder / "wandb-config"))


@dataclass
class OfflineRun:
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # name -> (step, value)
    config: dict = field(default_factory=dict)


def records(path: Path):
    """wandb's protobuf Records in the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _, _ = FILE_HEADER.unpack_from(data)
    assert ident == b":W&B", f"{path} is not a W&B run file"
    position, pieces = FILE_HEADER.size, b""
    while position + HEADER.size <= len(data):
        if BLOCK - position % BLOCK < HEADER.size:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = HEADER.unpack_from(data, position)
        start = position + HEADER.size
        pieces += data[start : start + length]
        position = start + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


def read_offline_run(folder: Path) -> OfflineRun:
    """The one offline run under `folder`: its project, name and tags, each logged name's
    (step, value) pairs, and the config (wandb's own `_wandb` entry left out)."""
    (path,) = folder.rglob("*.wandb")
    run = OfflineRun()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.project, run.name, run.tags = record.run.project, record.run.display_name, list(record.run.tags)
        if kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            run.config.update({item.key: json.loads(item.value_json) for item in updates if item.key != "_wandb"})
        elif kind == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for name, value in row.items():
                if not name.startswith("_"):
                    run.history.setdefault(name, []).append((row["_step"], value))
    return run
