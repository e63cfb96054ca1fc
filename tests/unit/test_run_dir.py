"""titanlite/observe/run_dir.py: the run folder's config.toml reads back to the run's config, runs
started in the same second get their own folders, an unwritable dump folder is one line, and
metrics.jsonl reads back with a torn last line skipped."""

from __future__ import annotations

import pytest

from titanlite.config import JobConfig, load_config
from titanlite.errors import TitanliteError
from titanlite.observe.run_dir import CONFIG_FILE, METRICS_FILE, create_run_dir, read_metrics, start_run_dir


def test_config_toml_reads_back_to_the_config_used(tmp_path):
    argv = [
        "--config",
        "debug_model",
        "--optimizer.lr",
        "3e-4",
        "--lr_scheduler.decay_ratio",
        "none",
        "--parallelism.fsdp_shard_modules",
        "TransformerBlock,Attention",
        "--job.dump_folder",
        str(tmp_path),
    ]
    cfg = load_config(argv)
    run_dir = create_run_dir(cfg)
    assert run_dir.parent == tmp_path / cfg.metrics.save_runs_folder
    assert load_config(["--config", str(run_dir / CONFIG_FILE)]) == cfg
    assert sorted(p.name for p in run_dir.iterdir()) == [CONFIG_FILE]  # no temporary file left


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    folders = {create_run_dir(cfg) for _ in range(3)}
    assert len(folders) == 3 and all((f / CONFIG_FILE).is_file() for f in folders)


def test_unwritable_dump_folder_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cfg = JobConfig()
    cfg.job.dump_folder = str(blocker)
    with pytest.raises(TitanliteError, match=r"^job\.dump_folder: cannot write the run folder under .*a_file/runs"):
        start_run_dir(cfg)  # no process group: rank 0 of 1


def test_a_torn_last_line_is_skipped_and_a_broken_middle_line_is_an_error(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(TitanliteError, match=rf"{METRICS_FILE}:1: not a JSON object"):
        read_metrics(tmp_path)
