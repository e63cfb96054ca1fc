"""The `fault_tolerance` section's one-line errors, the launcher-side checks before any device is
used (torchft missing, no lighthouse address), each replica group's share of the data and its own
dump folder. The groups themselves train in tests/runs/test_fault_tolerance.py."""

from __future__ import annotations

import sys

import pytest
import torch

from titanlite.config import load_config
from titanlite.errors import TitanliteError
from titanlite.runtime.fault_tolerance import LIGHTHOUSE_ENV, data_share, prepare_replica_group

ON = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        ([*ON, "--fault_tolerance.replica_id", "2"], "fault_tolerance.replica_id: must be in [0, group_size 2)"),
        (["--fault_tolerance.enable", "true"], "fault_tolerance.group_size: must be >= 1 when enable is true (got 0)"),
        ([*ON, "--fault_tolerance.min_replica_size", "3"], "min_replica_size: 3 is more than group_size"),
        ([*ON, "--fault_tolerance.process_group", "mpi"], "fault_tolerance.process_group: must be one of"),
        ([*ON, "--fault_tolerance.semi_sync_method", "hogwild"], "fault_tolerance.semi_sync_method: must be one of"),
        ([*ON, "--fault_tolerance.sync_steps", "0"], "fault_tolerance.sync_steps: must be > 0"),
        ([*ON, "--fault_tolerance.outer_momentum", "1"], "fault_tolerance.outer_momentum: must be"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(argv, named):
    with pytest.raises(TitanliteError) as error:
        load_config(["--config", "debug_model", *argv])
    assert named in str(error.value) and "\n" not in str(error.value)


def test_good_values_load():
    cfg = load_config(["--config", "debug_model", *ON, "--fault_tolerance.semi_sync_method", "diloco"])
    assert (cfg.fault_tolerance.semi_sync_method, cfg.fault_tolerance.group_size) == ("diloco", 2)
    assert load_config(["--config", "debug_model", *ON, "--fault_tolerance.semi_sync_method", "none"])


def test_each_group_reads_its_share_of_every_global_batch():
    """Group g's dp ranks are g*dp .. g*dp+dp-1 of group_size*dp: HSDP's flattened dp ranks."""
    ft = load_config(["--config", "debug_model", *ON, "--fault_tolerance.replica_id", "1"]).fault_tolerance
    assert [data_share(ft, r, 2) for r in (0, 1)] == [(2, 4), (3, 4)]
    off = load_config(["--config", "debug_model"]).fault_tolerance
    assert data_share(off, 1, 2) == (1, 2)


def test_missing_lighthouse_torchft_and_the_groups_folders(monkeypatch, tmp_path):
    cfg = load_config(["--config", "debug_model", *ON, "--job.dump_folder", str(tmp_path)])
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(TitanliteError, match=f"fault_tolerance.enable: {LIGHTHOUSE_ENV} is not set"):
        prepare_replica_group(cfg)
    monkeypatch.setitem(sys.modules, "torchft", None)  # an interpreter without the ft extra
    with pytest.raises(TitanliteError, match=r"needs torchft, which is not installed \(pip install 'titanlite\[ft\]"):
        prepare_replica_group(cfg)
    monkeypatch.delitem(sys.modules, "torchft")
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://localhost:29510")
    assert prepare_replica_group(cfg) == str(tmp_path / "replica_0")
    assert cfg.job.dump_folder == str(tmp_path)  # the group's folder goes into the plan: no config is edited


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host has NCCL: nothing to refuse")
def test_nccl_without_cuda_is_one_line(monkeypatch, tmp_path):
    """torchft's NCCL process group on a CPU-only torch ends in its own traceback
    (`module 'torch._C' has no attribute '_nccl_version'`): one line before, naming the key."""
    cfg = load_config(["--config", "debug_model", *ON, "--fault_tolerance.process_group", "nccl"])
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://localhost:29510")
    with pytest.raises(TitanliteError, match="fault_tolerance.process_group: nccl needs CUDA devices") as error:
        prepare_replica_group(cfg)
    assert "\n" not in str(error.value)
