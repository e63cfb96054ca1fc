"""Start-up progress of checkpoint loads: a DCP load through ProgressReader and a Hugging
Face import say how much there is, how far they got, and how long it took."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint import export
from titanlite.checkpoint.load_progress import ProgressReader, files_with_progress
from titanlite.errors import TitanliteError


@pytest.fixture
def progress_lines(caplog, monkeypatch):
    """The titanlite logger's INFO messages of the test, in order."""
    monkeypatch.setattr(logging.getLogger("titanlite"), "propagate", True)
    caplog.set_level(logging.INFO, logger="titanlite")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "titanlite"]


def test_dcp_load_reports_size_progress_and_time_and_loads_the_same_tensors(tmp_path, progress_lines):
    saved = {f"layer{i}.weight": torch.randn(64, 256) for i in range(4)}  # 4 x 64 KiB
    saved["step"] = torch.tensor(7)
    with export.single_process():
        dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
        loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
        dcp.load(loaded, storage_reader=ProgressReader(tmp_path, every_s=0.0), no_dist=True)

    for key, tensor in saved.items():
        assert torch.equal(loaded[key], tensor), key
    lines = progress_lines()
    name = tmp_path.name
    size = r"2[67]\d\.\d KB"  # the tensors' 262 KB and DCP's per-item framing
    assert re.fullmatch(rf"checkpoint load: {re.escape(str(tmp_path))} holds ({size}) in 1 file; this rank reads \1",
                        lines[0]), lines[0]
    during = [line for line in lines[1:-1] if line.startswith(f"checkpoint load: {name}: ")]
    assert len(during) == len(saved) and re.match(rf".*: 100% \(({size}) of \1\)", during[-1]), lines
    assert re.fullmatch(rf"checkpoint load: {re.escape(name)}: done, {size} in \d+ s", lines[-1]), lines[-1]


def test_hugging_face_import_reports_each_file(tmp_path, progress_lines):
    import safetensors.torch as st
    for index in range(3):
        st.save_file({f"t{index}": torch.ones(1000)}, str(tmp_path / f"model-{index}.safetensors"))

    tensors = export.read_hf_tensors(tmp_path)

    assert sorted(tensors) == ["t0", "t1", "t2"]
    lines = progress_lines()
    what = f"Hugging Face import from {tmp_path}"
    assert lines[0].startswith(f"{what}: 3 files, 12.")
    assert lines[-1].startswith(f"{what}: done, 12.") and "KB in" in lines[-1]


def test_a_missing_file_stays_the_readers_error_to_report(tmp_path, progress_lines):
    names = ["here.bin", "gone.bin"]
    (tmp_path / "here.bin").write_bytes(b"x" * 2000)
    seen = []
    with pytest.raises(TitanliteError, match="gone.bin"):
        for name in files_with_progress("reading", tmp_path, names, every_s=0.0):
            if not (tmp_path / name).is_file():
                raise TitanliteError(f"{tmp_path / name}: missing")
            seen.append(name)
    assert seen == ["here.bin"]
    lines = progress_lines()  # a missing file counts as empty; the reader's error ends it
    assert lines[0] == "reading: 2 files, 2.0 KB" and lines[1].startswith("reading: 100% (2.0 KB of 2.0 KB)")
    assert not any("done" in line for line in lines)
