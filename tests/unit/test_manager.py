"""titanlite/checkpoint/manager.py on one plain process (no torch.distributed): save, retention
(retired in the step, deleted on the housekeeping thread), resume with a rank the checkpoint has
no RNG state for, recorded checksums that name a corrupted shard, and a resume with another
tokenizer refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.stand_ins import TINY, CountingLoader, tiny_model
from titanlite.checkpoint import commit, export, integrity
from titanlite.checkpoint.train_state import TrainState
from titanlite.config import Checkpoint
from titanlite.errors import TitanliteError


def _manager(folder, model, tokenizer=None, **cfg):
    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.models.llama import llama3_spec

    checkpoint_cfg = Checkpoint(
        **{"enable_checkpoint": True, "interval": 1, "async_mode": "disabled", "keep_latest_k": 1, **cfg}
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state, data = TrainState(), CountingLoader()
    manager = CheckpointManager(
        checkpoint_cfg,
        str(folder),
        llama3_spec,
        "tiny",
        TINY,
        model=model,
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        dataloader=data,
        train_state=state,
        tokenizer=tokenizer,
    )
    return manager, optimizer, state, data


def test_manager_without_process_group_resumes_and_tolerates_missing_rng(tmp_path, monkeypatch):
    """One plain process (no torch.distributed): save, retention, resume; a rank the
    checkpoint has no RNG state for (it was saved at a smaller world) keeps its own."""
    import warnings

    from titanlite.checkpoint import train_state as train_state_module

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model = tiny_model(seed=5)
    manager, optimizer, state, data = _manager(tmp_path, model)
    for step in (1, 2):
        model(torch.randint(0, TINY.vocab_size, (1, 8))).sum().backward()
        optimizer.step()
        state.step, data.position = step, step * 8
        manager.save(step, last=step == 2)
    manager.close()
    assert commit.scan(tmp_path / "checkpoint").complete == (2,)  # keep_latest_k 1

    fresh = tiny_model(seed=6)
    monkeypatch.setattr(train_state_module, "_rank", lambda: 1)
    again, _, state2, data2 = _manager(tmp_path, fresh)  # as if rank 1 of a larger world than the checkpoint's
    again.load()
    assert (state2.step, data2.position) == (2, 16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def _train_and_save(manager, model, optimizer, state, data, steps) -> None:
    for step in steps:
        model(torch.randint(0, TINY.vocab_size, (1, 8))).sum().backward()
        optimizer.step()
        state.step, data.position = step, step * 8
        manager.save(step, last=False)


def test_retention_retires_in_the_step_and_deletes_in_the_background(tmp_path, monkeypatch):
    """An old step leaves the checkpoint set inside `save` (un-committed, moved to .trash);
    the delete itself runs on the housekeeping thread; a crash's leftovers go next run."""
    import shutil
    import threading
    import warnings

    from titanlite.checkpoint import housekeeping

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    deleted_by, real_rmtree = [], shutil.rmtree

    def rmtree(path, *args, **kwargs):
        deleted_by.append((Path(path).name.split(".")[0], threading.current_thread().name))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(housekeeping.shutil, "rmtree", rmtree)
    root = tmp_path / "checkpoint"
    (root / commit.TRASH_DIR / "step-0.123").mkdir(parents=True)  # left by a run that crashed mid-delete
    model = tiny_model(seed=7)
    manager, optimizer, state, data = _manager(tmp_path, model, keep_latest_k=2)
    _train_and_save(manager, model, optimizer, state, data, (1, 2, 3, 4))
    assert commit.scan(root).complete == (3, 4)  # retired at once: discovery no longer sees 1 and 2
    manager.close()
    assert sorted(deleted_by) == [
        ("step-0", "titanlite-housekeeping"),
        ("step-1", "titanlite-housekeeping"),
        ("step-2", "titanlite-housekeeping"),
    ]
    assert list((root / commit.TRASH_DIR).iterdir()) == []


def test_checksums_are_recorded_and_a_shard_corrupted_inside_its_data_is_named(tmp_path):
    """Flipped bytes in the middle of a shard deserialize fine; the checksum catches them."""
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model = tiny_model(seed=8)
    manager, optimizer, state, data = _manager(tmp_path, model)
    _train_and_save(manager, model, optimizer, state, data, (1,))
    manager.close()
    folder = commit.step_dir(tmp_path / "checkpoint", 1)
    record = commit.read_commit(folder)
    shards = sorted(p.name for p in folder.glob("*.distcp"))
    assert sorted(record.checksums) == shards and not integrity.sidecars(folder)  # merged, then cleaned up
    assert all(integrity.file_crc32(folder / name) == crc for name, crc in record.checksums.items())

    shard = folder / shards[0]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    again, *_ = _manager(tmp_path, tiny_model(seed=9))
    with pytest.raises(
        TitanliteError,
        match=f"^{shard}: shard file is corrupted \\(CRC-32 [0-9a-f]{{8}}, recorded at save "
        f"{record.checksums[shard.name]}\\)$",
    ):
        again.load()
    again.close()
    with pytest.raises(TitanliteError, match="shard file is corrupted"):
        export.read_dcp_model(folder)  # the export and conversion scripts read through here


def test_resume_with_another_tokenizer_is_refused(tmp_path):
    import types
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    tokenizer_file = tmp_path / "tok.model"
    tokenizer_file.write_bytes(b"tokenizer A" * 100)
    model = tiny_model(seed=10)
    manager, optimizer, state, data = _manager(
        tmp_path, model, tokenizer=types.SimpleNamespace(path=str(tokenizer_file), vocab_size=96)
    )
    _train_and_save(manager, model, optimizer, state, data, (1,))
    manager.close()
    assert commit.read_commit(commit.step_dir(tmp_path / "checkpoint", 1)).tokenizer == {
        "path": str(tokenizer_file),
        "vocab_size": 96,
        "crc32": integrity.file_crc32(tokenizer_file),
    }

    other = tmp_path / "other.model"
    other.write_bytes(b"tokenizer B" * 100)
    for tokenizer, difference in [
        ((other, 96), "CRC-32"),
        ((tokenizer_file, 100), "its vocabulary has 100 tokens, the checkpoint's 96"),
    ]:
        again, *_ = _manager(
            tmp_path,
            tiny_model(seed=11),
            tokenizer=types.SimpleNamespace(path=str(tokenizer[0]), vocab_size=tokenizer[1]),
        )
        with pytest.raises(TitanliteError, match="^model.tokenizer_path: ") as info:
            again.load()
        again.close()
        assert (
            f"is not the tokenizer {tmp_path / 'checkpoint' / 'step-1'} was trained with ({tokenizer_file}): "
            f"{difference}" in str(info.value)
        )
