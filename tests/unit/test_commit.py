"""titanlite/checkpoint/commit.py: the commit record is written by an atomic rename and reads back."""

from __future__ import annotations

import os

from titanlite.checkpoint import commit


def test_commit_is_atomic_rename_and_round_trips(tmp_path):
    record = commit.CommitRecord(step=3, fingerprint={"name": "llama3"}, contents=["model"], mesh={"tp": 2})
    commit.write_commit(tmp_path, record)
    assert sorted(os.listdir(tmp_path)) == [commit.COMMIT_FILE]
    again = commit.read_commit(tmp_path)
    assert again.step == 3 and again.mesh == {"tp": 2} and again.saved_at
    commit.remove_commit(tmp_path)
    assert commit.read_commit(tmp_path) is None
