"""titanlite/checkpoint/policy.py: when to save and what kind of save, which step a run resumes from
(the newest committed, weights-only exports skipped, a named step or nothing), which folder an
initial load reads, and what retention removes."""

from __future__ import annotations

import dataclasses

import pytest

from titanlite.checkpoint import commit, policy
from titanlite.config import Checkpoint
from titanlite.errors import TitanliteError


def make_step(root, step: int, *, committed: bool = True, weights_only: bool = False) -> None:
    folder = commit.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    if committed:
        commit.write_commit(
            folder,
            commit.CommitRecord(
                step=step, fingerprint={"name": "x"}, contents=["model"], model_weights_only=weights_only
            ),
        )


def test_should_save_every_interval_and_at_the_end():
    assert [s for s in range(1, 11) if policy.should_save(s, 4, last=s == 10)] == [4, 8, 10]


def test_resume_picks_newest_committed_and_reports_incomplete(tmp_path):
    for step in (5, 10):
        make_step(tmp_path, step)
    make_step(tmp_path, 15, committed=False)
    choice = policy.choose_resume(tmp_path, -1)
    assert choice.step == 10 and choice.path == tmp_path / "step-10"
    assert len(choice.notes) == 1 and "step-15" in choice.notes[0] and "ignoring" in choice.notes[0]
    assert policy.choose_resume(tmp_path, 5).step == 5


def test_resume_skips_weights_only_exports_but_not_the_seed(tmp_path):
    make_step(tmp_path, 0, weights_only=True)
    assert policy.choose_resume(tmp_path, -1).step == 0
    make_step(tmp_path, 4)
    make_step(tmp_path, 8, weights_only=True)
    choice = policy.choose_resume(tmp_path, -1)
    assert choice.step == 4 and any("weights only" in n for n in choice.notes)
    with pytest.raises(TitanliteError, match="weights only"):
        policy.choose_resume(tmp_path, 8)


def test_empty_folder_starts_fresh(tmp_path):
    assert policy.choose_resume(tmp_path / "nothing", -1).step is None


@pytest.mark.parametrize(
    "setup, step, message",
    [
        ("none", 3, "does not exist"),
        ("some", 7, "step-7 does not exist; complete steps: 5"),
        ("some", 9, "step-9 is incomplete"),
    ],
)
def test_asked_for_load_step_never_starts_fresh(tmp_path, setup, step, message):
    root = tmp_path / "ckpt"
    if setup == "some":
        make_step(root, 5)
        make_step(root, 9, committed=False)
    with pytest.raises(TitanliteError, match=message) as info:
        policy.choose_resume(root, step)
    assert "\n" not in str(info.value) and "checkpoint.load_step" in str(info.value)


def test_retention_keeps_latest_k_and_cleans_older_debris():
    assert policy.retention_victims([2, 4, 6, 8], 2, 8) == [2, 4]
    assert policy.retention_victims([2, 4], 0, 4) == []
    assert policy.retention_victims([2, 4, 6], 1, 4) == [2]  # a newer folder (another timeline) is not counted
    assert policy.stale_incomplete([3, 9], 6) == [3]


def test_save_kind_last_step_is_blocking_and_weights_only_when_asked():
    cfg = Checkpoint(async_mode="async", model_weights_only=True, export_dtype="bfloat16")
    assert policy.save_kind(cfg, last=False) == policy.SaveKind(weights_only=False, export_dtype=None, blocking=False)
    assert policy.save_kind(cfg, last=True) == policy.SaveKind(
        weights_only=True, export_dtype="bfloat16", blocking=True
    )
    full = Checkpoint(async_mode="disabled")
    assert policy.save_kind(full, last=False).blocking and not policy.save_kind(full, last=True).weights_only
    seed = commit.CommitRecord(step=0, fingerprint={}, contents=["model"], model_weights_only=True)
    assert not policy.is_export(seed) and policy.is_export(dataclasses.replace(seed, step=5))


def test_initial_load_accepts_dcp_folder_or_root(tmp_path):
    make_step(tmp_path / "root", 3)
    make_step(tmp_path / "root", 6)
    assert policy.resolve_initial_load(tmp_path / "root")[0] == tmp_path / "root" / "step-6"
    assert policy.resolve_initial_load(tmp_path / "root" / "step-3")[0] == tmp_path / "root" / "step-3"
    with pytest.raises(TitanliteError, match="does not exist"):
        policy.resolve_initial_load(tmp_path / "missing")
    with pytest.raises(TitanliteError, match="not a DCP checkpoint"):
        policy.resolve_initial_load(tmp_path)
