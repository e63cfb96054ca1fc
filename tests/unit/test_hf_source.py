"""titanlite/data/hf_source.py: without `datasets` one line names the extra; a local .jsonl through
`datasets` gives its documents in order."""

from __future__ import annotations

import json
import sys

import pytest

from titanlite.data.hf_source import HFSource
from titanlite.errors import TitanliteError


def test_hf_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(TitanliteError, match=r"pip install titanlite\[hf\]"):
        HFSource("allenai/c4")


def test_hf_local_jsonl(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    assert list(HFSource(str(path)).one_pass()) == [f"doc {i}" for i in range(5)]
