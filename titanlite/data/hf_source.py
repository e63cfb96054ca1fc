"""A Hugging Face `datasets` stream as a document source, for the prepare command
(`python -m titanlite.data.prepare hf:NAME OUTPUT`): read once, in order, tokenized by
its worker processes. Training never streams it; it reads the prepared shards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titanlite.data.sources import Source
from titanlite.errors import TitanliteError, user_errors


class HFSource(Source):
    """A Hugging Face `datasets` stream (`pip install titanlite[hf]`), split "train",
    `streaming=True`, field "text". `path` is a hub name (optionally `name:config`, e.g.
    `allenai/c4:en`), a local folder (datasets infers the builder from its files) or one
    local .txt/.json/.jsonl/.parquet/.csv file (read with the matching builder).

    Only `python -m titanlite.data.prepare` reads it: once, in order, tokenizing in worker
    processes; training reads the shards.
    """

    BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

    def __init__(self, path: str) -> None:
        try:
            import datasets
        except ImportError:
            raise TitanliteError(
                "training.dataset: 'hf' needs the datasets package: pip install titanlite[hf]"
            ) from None
        self.path = path
        self.name = f"hf:{path}"
        self.empty_message = f"training.dataset_path: no documents in {self.name}"
        with user_errors(f"training.dataset_path: cannot open Hugging Face dataset {path!r}"):
            self.dataset = self._open(datasets, path)

    def _open(self, datasets: Any, path: str) -> Any:
        """The streaming "train" split of a local file, a local folder or a hub name."""
        p = Path(path)
        if p.is_file():
            if p.suffix not in self.BUILDERS:
                raise TitanliteError(f"training.dataset_path: unsupported file type {p.suffix or '(none)'}: {path}")
            return datasets.load_dataset(self.BUILDERS[p.suffix], data_files=str(p), split="train", streaming=True)
        if p.is_dir():
            return datasets.load_dataset(str(p), split="train", streaming=True)
        name, _, config = path.partition(":")
        return datasets.load_dataset(name, config or None, split="train", streaming=True)

    def _documents(self) -> Iterator[str]:
        for example in self.dataset:
            if "text" not in example:
                raise TitanliteError(
                    f'training.dataset_path: Hugging Face dataset {self.path!r} has no "text" field (fields: '
                    f"{', '.join(example)})"
                )
            yield example["text"]
