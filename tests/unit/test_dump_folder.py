"""Start-up checks on the dump and checkpoint folders and the dump-folder lock, on the real file system
(one process; a lock left by a killed job: tests/runs/test_dump_folder.py; the trainer's use of
them: tests/runs/test_bad_input.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from titanlite.config import JobConfig
from titanlite.errors import TitanliteError
from titanlite.runtime import dump_folder

AS_ROOT = os.geteuid() == 0


def message(call, *args) -> str:
    with pytest.raises(TitanliteError) as info:
        call(*args)
    text = str(info.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------ writable folders


def test_dump_folder_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    folder = tmp_path / "file" / "out" / "deeper"
    assert message(dump_folder.make_writable_folder, folder, "job.dump_folder") == (
        f"job.dump_folder: cannot create the folder {folder}: {tmp_path / 'file'} is a file"
    )
    assert message(dump_folder.make_writable_folder, tmp_path / "file", "job.dump_folder").endswith(
        f"{tmp_path / 'file'} is a file"
    )


@pytest.mark.skipif(AS_ROOT, reason="root writes in a chmod 0o500 folder anyway: this case cannot fail as root")
def test_read_only_folder_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert message(dump_folder.make_writable_folder, locked, "job.dump_folder") == (
            f"job.dump_folder: cannot write in {locked}: permission denied"
        )
        assert "permission denied" in message(dump_folder.make_writable_folder, locked / "sub", "job.dump_folder")
    finally:
        locked.chmod(0o700)


def test_writable_folder_is_created_and_left_clean(tmp_path):
    folder = tmp_path / "a" / "b"
    dump_folder.make_writable_folder(folder, "job.dump_folder")
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_checkpoint_folder_is_checked_but_not_created(tmp_path):
    assert dump_folder.check_creatable_folder(tmp_path / "ckpt" / "x", "checkpoint.folder") == tmp_path
    assert not (tmp_path / "ckpt").exists()
    (tmp_path / "ckpt").write_text("x")
    assert message(dump_folder.check_creatable_folder, tmp_path / "ckpt" / "x", "checkpoint.folder").endswith(
        f"{tmp_path / 'ckpt'} is a file"
    )


# ------------------------------------------------------------------ free disk


def test_free_disk_below_one_checkpoint_is_refused(tmp_path):
    dump_folder.check_free_disk(tmp_path, 1_000_000, weights_only=False)
    huge = 400 * 10**12  # 400T parameters: 4.8 PB with AdamW state, more than any test disk
    text = message(dump_folder.check_free_disk, tmp_path, huge, False)
    assert text.startswith(f"checkpoint.folder: the disk of {tmp_path} has ") and "400,000.00B parameters" in text
    assert (
        dump_folder.checkpoint_bytes(10, weights_only=False) == 120
        and dump_folder.checkpoint_bytes(10, weights_only=True) == 40
    )


def test_parameter_count_builds_on_meta():
    from titanlite.build import plan_run
    from titanlite.config import load_config

    assert plan_run(load_config(["--model.flavor", "405B"]), 1, vocab_size=128256).n_params > 400e9


# ------------------------------------------------------------------ the lock


def test_second_holder_is_refused_naming_the_first_until_released(tmp_path):
    first = dump_folder.acquire_lock(tmp_path)
    holder = json.loads((tmp_path / dump_folder.LOCK_FILE).read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    text = message(dump_folder.acquire_lock, tmp_path)
    assert text.startswith(
        f"job.dump_folder: {tmp_path} is in use by another run (host {socket.gethostname()}, pid {os.getpid()}, "
        "started "
    )
    first.release()
    assert (tmp_path / dump_folder.LOCK_FILE).read_text() == ""  # a clean exit leaves no holder
    dump_folder.acquire_lock(tmp_path).release()


def test_without_flock_the_recorded_holder_decides(tmp_path):
    """File systems without flock: a holder on this host is alive or stale by its pid; one
    on another host cannot be checked and is refused with the file to delete."""
    path = tmp_path / dump_folder.LOCK_FILE
    here = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    started = {"started": "2026-01-01T00:00:00"}
    assert "in use by another run" in dump_folder._refusal(path, {"host": here, "pid": os.getpid(), **started}, None)
    assert dump_folder._refusal(path, {"host": here, "pid": dead.pid, **started}, None) is None
    assert f"delete {path} if it does not" in dump_folder._refusal(
        path, {"host": "elsewhere", "pid": 1, **started}, None
    )
    assert dump_folder._refusal(path, {}, None) is None


def test_lock_is_released_when_the_holder_is_collected(tmp_path):
    """A start-up that fails after taking the lock drops its RunLock: that frees it."""
    dump_folder.acquire_lock(tmp_path)  # not kept
    dump_folder.acquire_lock(tmp_path).release()


def test_claim_checks_then_locks_on_one_process(tmp_path):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path / "run")
    cfg.checkpoint.enable_checkpoint = True
    asked = []
    lock = dump_folder.claim_dump_folder(cfg, lambda: asked.append(1) or 1000, None)
    assert asked == [1] and (tmp_path / "run" / dump_folder.LOCK_FILE).is_file()
    assert not (tmp_path / "run" / "checkpoint").exists()
    lock.release()
    cfg.checkpoint.enable_checkpoint = False
    dump_folder.claim_dump_folder(cfg, lambda: pytest.fail("no checkpoints, no disk check"), None).release()
