"""torchtitan's own TOML files run with titanlite once the dataset line is the only edit.

tests/torchtitan_configs/ holds torchtitan v0.2.2's files as published (tag v0.2.2, commit
73a0e69, `torchtitan/models/<family>/train_configs/`; a debug_model.toml renamed after its
family): every Llama 3 and Qwen3 file, and the debug files of three families titanlite does not
have. The debug files train for two steps, on torchtitan's flavor shapes; the big ones plan.
Unedited, each stops at its dataset in one line that says how to prepare local data; torchtitan's
options titanlite does not have are one note each, and a family titanlite lacks is named first.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import REPO, run_env

CONFIGS = Path(__file__).resolve().parents[1] / "torchtitan_configs"
DOWNLOADS = {"c4": 'dataset = "c4"', "c4_test": 'dataset = "c4_test"'}
# The big files: the world and the device memory each one's NOTE line is for (8 GPUs when it has none),
# and the vocabulary of the tokenizer its hf_assets_path names.
PLANNED = {
    "llama3_8b": (64, "80GiB", 128256),
    "llama3_70b": (64, "80GiB", 128256),
    "llama3_405b": (128, "80GiB", 128256),
    "qwen3_0.6b": (8, "80GiB", 151936),
    "qwen3_1.7b": (8, "80GiB", 151936),
    "qwen3_32b": (8, "96GiB", 151936),
}
TRAINED = ("llama3_debug_model", "qwen3_moe_debug")
ABSENT = ("llama4_debug_model", "gpt_oss_debug_model")
# A family titanlite has, whose torchtitan files are not translated (no torchtitan: flavors for it yet).
UNTRANSLATED = ("deepseek_v3_debug_model",)
# What the 405B file turns on that titanlite does not have, and the value that turns it off
# (its float8 training, with float8 all-gather and precomputed scales, is planned as it is).
LLAMA3_405B_ON = {
    "enable_async_tensor_parallel = true": "enable_async_tensor_parallel = false",
}


def local(text: str) -> str:
    """The file with its download replaced by the built-in corpus: the only edit."""
    for line in DOWNLOADS.values():
        text = text.replace(line, 'dataset = "builtin"', 1)
    return text


@pytest.fixture
def workdir(tmp_path) -> Path:
    """torchtitan's files as published, a `_local` copy of each with the dataset edited, and
    the tokenizer folder the debug files name (the shipped tokenizer as its tokenizer.model)."""
    (tmp_path / "tests" / "assets" / "tokenizer").mkdir(parents=True)
    shutil.copy(
        REPO / "assets" / "tokenizer" / "titanlite.model",
        tmp_path / "tests" / "assets" / "tokenizer" / "tokenizer.model",
    )
    for path in CONFIGS.glob("*.toml"):
        shutil.copy(path, tmp_path / path.name)
        (tmp_path / f"{path.stem}_local.toml").write_text(local(path.read_text()))
    return tmp_path


def run(workdir: Path, module: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=workdir, env=run_env(), capture_output=True, text=True, timeout=300
    )


def notes(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("titanlite: note: ")]


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a refused run prints (exit code 2, nothing else on stderr)."""
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_the_fixtures_are_every_llama3_and_qwen3_file():
    names = {path.stem for path in CONFIGS.glob("*.toml")}
    assert names == {*PLANNED, *TRAINED, *ABSENT, *UNTRANSLATED}
    for name in (*PLANNED, *TRAINED):
        assert sum(line in (CONFIGS / f"{name}.toml").read_text() for line in DOWNLOADS.values()) == 1, name


@pytest.mark.timeout(600)
def test_torchtitans_files_stop_only_at_their_download(workdir):
    for name in (*PLANNED, *TRAINED):
        text = (CONFIGS / f"{name}.toml").read_text()
        dataset = next(dataset for dataset, line in DOWNLOADS.items() if line in text)
        if name == "llama3_405b":  # async TP comes first: titanlite has none (below)
            (workdir / f"{name}.toml").write_text(_replace_all(text, LLAMA3_405B_ON))
        line = error_line(run(workdir, "titanlite.config", "--config", f"{name}.toml"))
        assert line.startswith(f"titanlite: error: training.dataset: '{dataset}' is a dataset torchtitan downloads"), (
            name,
            line,
        )
        assert "python -m titanlite.data.prepare" in line


@pytest.mark.timeout(600)
def test_the_llama3_debug_file_trains_torchtitans_debugmodel_and_says_what_it_leaves_out(workdir):
    result = run(workdir, "titanlite.train", "--config", "llama3_debug_model_local.toml", "--training.steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     2  loss" in result.stdout, result.stdout[-2000:]
    # torchtitan's debugmodel: 16 heads, no GQA (titanlite's own has 8 heads and 4 kv heads)
    assert "model llama3 torchtitan:debugmodel:" in result.stdout, result.stdout[-2000:]
    said = notes(result)
    # metrics.enable_wandb = false is titanlite's own option, [quantize.linear.float8] its [float8]: no note
    assert len(said) == 6, said
    for key in (
        "metrics.disable_color_printing",
        "parallelism.enable_async_tensor_parallel = false",
        "compile.components",
        "validation.dataset = 'c4_validation'",
        "optimizer.param_groups = [] in llama3_debug_model_local.toml: torchtitan decays every parameter",
        "model.flavor = 'debugmodel' in llama3_debug_model_local.toml: the file is torchtitan's, so torchtitan's",
    ):
        assert sum(key in line for line in said) == 1, (key, said)


@pytest.mark.timeout(600)
def test_the_qwen3_moe_debug_file_trains_torchtitans_64_experts(workdir):
    """torchtitan's debugmodel_moe (8 layers, 16 heads of 128, 64 experts top-8 of width 768,
    expert-bias balancing) has 317M parameters, 302M of them experts: about 6 GiB resident with
    AdamW. Its seq_len 4096 (16k tokens a step) would take minutes a step on two cores; seq_len
    128 trains the same model, every layer and the bias update, in about 20 s of CPU."""
    result = run(
        workdir,
        "titanlite.train",
        "--config",
        "qwen3_moe_debug_local.toml",
        "--training.steps",
        "2",
        "--training.seq_len",
        "128",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model qwen3 torchtitan:debugmodel_moe: " in result.stdout, result.stdout[-2000:]
    assert "step     2  loss" in result.stdout and "moe_load" in result.stdout, result.stdout[-2000:]
    said = notes(result)
    for key in (
        "optimizer.param_groups = [] in qwen3_moe_debug_local.toml: torchtitan decays every parameter",
        "model.flavor = 'debugmodel_moe' in qwen3_moe_debug_local.toml: the file is torchtitan's",
    ):
        assert sum(key in line for line in said) == 1, (key, said)


@pytest.mark.parametrize("name", list(PLANNED))
def test_the_big_files_plan_on_torchtitans_flavors(workdir, name):
    world, memory, vocab = PLANNED[name]
    if name == "llama3_405b":
        line = error_line(run(workdir, "titanlite.config", "--config", f"{name}_local.toml"))
        assert line.startswith("titanlite: error: parallelism.enable_async_tensor_parallel: not supported"), line
        (workdir / f"{name}_local.toml").write_text(
            _replace_all((workdir / f"{name}_local.toml").read_text(), LLAMA3_405B_ON)
        )
    argv = ["--world-size", str(world), "--device-memory", memory, "--vocab-size", str(vocab)]
    result = run(workdir, "titanlite.plan", "--config", f"{name}_local.toml", *argv)
    assert result.returncode == 0 and "verdict: fits" in result.stdout, result.stdout + result.stderr
    flavor = (CONFIGS / f"{name}.toml").read_text().split('flavor = "')[1].split('"')[0]
    assert f"model: {name.split('_')[0]} torchtitan:{flavor}, " in result.stdout, result.stdout
    assert sum(f"model.flavor = '{flavor}'" in line for line in notes(result)) == 1, result.stderr
    if name == "llama3_8b":  # torchtitan's 8B is the published one
        assert "model: llama3 torchtitan:8B, 8,030,261,248 parameters" in result.stdout
        assert "activation checkpointing selective (per op)" in result.stdout


@pytest.mark.parametrize("name", ABSENT)
def test_a_family_titanlite_lacks_is_named_first(workdir, name):
    """Its files set options (downloads, its own model keys) that would otherwise be refused first."""
    family = name.removesuffix("_debug_model")
    line = error_line(run(workdir, "titanlite.config", "--config", f"{name}.toml"))
    assert line.startswith(f"titanlite: error: model.name: '{family}' in {name}.toml is a torchtitan model family"), (
        line
    )


@pytest.mark.parametrize("name", UNTRANSLATED)
def test_a_deepseek_v3_file_is_read_to_its_download_dataset(workdir, name):
    """deepseek_v3 is titanlite's family now: its file is not refused by name, and the first line is its download."""
    line = error_line(run(workdir, "titanlite.config", "--config", f"{name}.toml"))
    assert line.startswith("titanlite: error: training.dataset: 'c4_test' is a dataset torchtitan downloads"), line


def test_an_option_titanlite_lacks_is_refused_when_on(workdir):
    text = local((CONFIGS / "llama3_debug_model.toml").read_text())
    (workdir / "async_tp.toml").write_text(
        text.replace("enable_async_tensor_parallel = false", "enable_async_tensor_parallel = true")
    )
    line = error_line(run(workdir, "titanlite.config", "--config", "async_tp.toml"))
    assert line.startswith("titanlite: error: parallelism.enable_async_tensor_parallel: not supported")
    (workdir / "mx.toml").write_text(text.replace('# converters = ["float8"]', 'converters = ["quantize.linear.mx"]'))
    line = error_line(run(workdir, "titanlite.config", "--config", "mx.toml"))
    assert line.startswith("titanlite: error: model.converters: quantize.linear.mx is not supported: MXFP8 needs"), line


def _replace_all(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    return text
