"""Start-up progress of checkpoint loads: a DCP load through ProgressReader and a Hugging
Face import say how much there is, how far they got, and how long it took."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint import export
from titanlite.checkpoint.load_progress import HFProgressReader, ProgressReader


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
    assert re.fullmatch(
        rf"checkpoint load: {re.escape(str(tmp_path))} holds ({size}) in 1 file; this rank reads \1", lines[0]
    ), lines[0]
    during = [line for line in lines[1:-1] if line.startswith(f"checkpoint load: {name}: ")]
    assert len(during) == len(saved) and re.match(rf".*: 100% \(({size}) of \1\)", during[-1]), lines
    assert re.fullmatch(rf"checkpoint load: {re.escape(name)}: done, {size} in \d+ s", lines[-1]), lines[-1]


def test_hugging_face_import_reports_size_progress_and_time(tmp_path, progress_lines):
    """A Hugging Face folder is read through `HFProgressReader`: the same three kinds of
    line, sized by the slices this rank reads (here all of three 4 KB tensors)."""
    import safetensors.torch as st

    for index in range(3):
        st.save_file({f"t{index}": torch.full((1000,), float(index))}, str(tmp_path / f"model-{index}.safetensors"))
    state = {f"t{index}": torch.zeros(1000) for index in range(3)}

    with export.single_process():
        dcp.load(state, storage_reader=HFProgressReader(tmp_path, every_s=0.0), no_dist=True)

    assert all(torch.equal(state[f"t{i}"], torch.full((1000,), float(i))) for i in range(3))
    lines = progress_lines()
    assert lines[0] == f"checkpoint load: {tmp_path} holds 12.0 KB in 3 files; this rank reads 12.0 KB", lines[0]
    assert re.fullmatch(rf"checkpoint load: {re.escape(tmp_path.name)}: done, 12.0 KB in \d+ s", lines[-1]), lines[-1]
