"""torchtitan's own TOML files (llama3 debug_model.toml and llama3_8b.toml, as torchtitan v0.2.2
published them, written out below) run with titanlite once the dataset line is the only edit:
the debug file trains, the 8B file plans. Unedited, each stops at its dataset in one line that
says how to prepare local data; torchtitan's options titanlite does not have are one note each."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import REPO, run_env

DEBUG_MODEL_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
# test folder with tokenizer.json, for debug purpose only
hf_assets_path = "./tests/assets/tokenizer"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2  # lr scheduler warm up, normally 20% of the train steps
decay_ratio = 0.8  # lr scheduler decay ratio, 80% of the train steps
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0  # grad norm clipping
steps = 10
dataset = "c4_test"  # supported datasets: c4_test (2K), c4 (177M)

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"  # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = '2'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
"""

LLAMA3_8B_TOML = """# NOTE: this toml config is a preset for 64 A100 GPUs.

[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[compile]
enable=false
components = ["model", "loss"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 500
steps = 1200 # Recommend value for c4_validation with world-size=8 and seq_len=8192
"""


@pytest.fixture
def workdir(tmp_path) -> Path:
    """torchtitan's files as published, the dataset line edited in copies, and the tokenizer
    folder the debug file names (the shipped tokenizer as its tokenizer.model)."""
    (tmp_path / "tests" / "assets" / "tokenizer").mkdir(parents=True)
    shutil.copy(
        REPO / "assets" / "tokenizer" / "titanlite.model",
        tmp_path / "tests" / "assets" / "tokenizer" / "tokenizer.model",
    )
    for name, text, download in (("debug_model", DEBUG_MODEL_TOML, "c4_test"), ("llama3_8b", LLAMA3_8B_TOML, "c4")):
        (tmp_path / f"{name}.toml").write_text(text)
        (tmp_path / f"{name}_local.toml").write_text(text.replace(f'dataset = "{download}"', 'dataset = "builtin"', 1))
    return tmp_path


def run(workdir: Path, module: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=workdir, env=run_env(), capture_output=True, text=True, timeout=300
    )


def notes(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("titanlite: note: ")]


@pytest.mark.timeout(600)
def test_torchtitans_files_stop_only_at_their_download(workdir):
    for name, dataset in (("debug_model", "c4_test"), ("llama3_8b", "c4")):
        result = run(workdir, "titanlite.config", "--config", f"{name}.toml")
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith(
            f"titanlite: error: training.dataset: '{dataset}' is a dataset torchtitan downloads"
        )
        assert "python -m titanlite.data.prepare" in result.stderr


@pytest.mark.timeout(600)
def test_the_debug_file_trains_and_says_what_it_leaves_out(workdir):
    result = run(workdir, "titanlite.train", "--config", "debug_model_local.toml", "--training.steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     2  loss" in result.stdout, result.stdout[-2000:]
    said = notes(result)
    assert len(said) == 5, said  # metrics.enable_wandb = false is titanlite's own option: no note
    for key in (
        "metrics.disable_color_printing",
        "parallelism.enable_async_tensor_parallel = false",
        "compile.components",
        "[quantize]",
        "validation.dataset = 'c4_validation'",
    ):
        assert sum(key in line for line in said) == 1, (key, said)


@pytest.mark.timeout(600)
def test_the_8b_file_plans_with_the_llama_3_vocabulary(workdir):
    result = run(
        workdir, "titanlite.plan", "--config", "llama3_8b_local.toml", "--world-size", "64", "--vocab-size", "128256"
    )
    assert result.returncode == 0, result.stderr
    assert "model: llama3 8B, 8,030,261,248 parameters" in result.stdout
    assert "activation checkpointing selective (per op)" in result.stdout and "verdict: fits" in result.stdout
    assert len(notes(result)) == 3, result.stderr  # compile.components, [quantize], the validation download


def test_an_option_titanlite_lacks_is_refused_when_on(workdir):
    text = DEBUG_MODEL_TOML.replace('dataset = "c4_test"', 'dataset = "builtin"').replace(
        "enable_async_tensor_parallel = false", "enable_async_tensor_parallel = true"
    )
    (workdir / "async_tp.toml").write_text(text)
    result = run(workdir, "titanlite.config", "--config", "async_tp.toml")
    assert result.returncode == 2 and result.stderr.startswith(
        "titanlite: error: parallelism.enable_async_tensor_parallel: not supported"
    )
    quantized = DEBUG_MODEL_TOML.replace('dataset = "c4_test"', 'dataset = "builtin"').replace(
        "enable_fsdp_float8_all_gather = false", "enable_fsdp_float8_all_gather = true"
    )
    (workdir / "float8.toml").write_text(quantized)
    result = run(workdir, "titanlite.config", "--config", "float8.toml")
    assert result.returncode == 2 and "linear.float8.enable_fsdp_float8_all_gather is not supported" in result.stderr
