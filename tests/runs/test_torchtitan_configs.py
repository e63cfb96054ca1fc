"""torchtitan's own TOML files run with titanlite once the dataset line is the only edit.

tests/torchtitan_configs/ holds torchtitan v0.2.2's files as published (tag v0.2.2, commit
73a0e69, `torchtitan/models/<family>/train_configs/`; a debug_model.toml renamed after its
family): every Llama 3, Qwen3 and DeepSeek-V3 file, and the debug files of two families titanlite
does not have. The debug files train for two steps, on torchtitan's flavor shapes; the big ones plan.
Unedited, each stops at its dataset in one line that says how to prepare local data; torchtitan's
options titanlite does not have are one note each, and a family titanlite lacks is named first.
The files of one command run in one interpreter (`mains_command`): its imports are paid once.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import warm_start
from tests.helpers.distributed import REPO, mains_command, run_env, split_mains

CONFIGS = Path(__file__).resolve().parents[1] / "torchtitan_configs"
DOWNLOADS = {"c4": 'dataset = "c4"', "c4_test": 'dataset = "c4_test"'}
# Where the DeepSeek-V3 671B file's own layout (ep 1, pp 1) does not fit (PLANNED).
DEEPSEEK_V3_671B_LAYOUT = ("--parallelism.pipeline_parallel_degree", "8", "--parallelism.expert_parallel_degree", "32")
# The big files: the world and the device memory each one's NOTE line is for (8 GPUs when it has none),
# and the vocabulary of the tokenizer its hf_assets_path names.
PLANNED = {
    "llama3_8b": (64, "80GiB", 128256),
    "llama3_70b": (64, "80GiB", 128256),
    "llama3_405b": (128, "80GiB", 128256),
    "qwen3_0.6b": (8, "80GiB", 151936),
    "qwen3_1.7b": (8, "80GiB", 151936),
    "qwen3_32b": (8, "96GiB", 151936),
    "deepseek_v3_16b": (8, "80GiB", 102400),
    # Its file's layout (ep 1, pp 1) fits no world of 80 GiB GPUs (FSDP gathers a block's 256 experts
    # whole, and each rank keeps 61 blocks' activations): planned on 256 GPUs at pp 8 x ep 32.
    "deepseek_v3_671b": (256, "80GiB", 129280, *DEEPSEEK_V3_671B_LAYOUT),
}
# The debug files, each trained for two steps at seq_len 128, their one override: the same model
# and every layer as at the files' 2048 and 4096 tokens a row (llama3's two steps at 2048 took 58 s
# of CPU in a suite run on this 2-core host; the MoE ones below).
SHORT = ["--training.seq_len", "128"]
TRAINED = ("llama3_debug_model", "qwen3_moe_debug", "deepseek_v3_debug_model")
ABSENT = ("llama4_debug_model", "gpt_oss_debug_model")
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


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """torchtitan's files as published, a `_local` copy of each with the dataset edited, the
    405B file's two with async TP off (`_sync`), and the tokenizer folder the debug files name (the
    shipped tokenizer as its tokenizer.model). No test edits them."""
    tmp_path = tmp_path_factory.mktemp("torchtitan")
    (tmp_path / "tests" / "assets" / "tokenizer").mkdir(parents=True)
    shutil.copy(
        REPO / "assets" / "tokenizer" / "titanlite.model",
        tmp_path / "tests" / "assets" / "tokenizer" / "tokenizer.model",
    )
    for path in CONFIGS.glob("*.toml"):
        shutil.copy(path, tmp_path / path.name)
        (tmp_path / f"{path.stem}_local.toml").write_text(local(path.read_text()))
    for name in ("llama3_405b", "llama3_405b_local"):
        (tmp_path / f"{name}_sync.toml").write_text(
            _replace_all((tmp_path / f"{name}.toml").read_text(), LLAMA3_405B_ON)
        )
    return tmp_path


def run(workdir: Path, module: str, *argv: str) -> subprocess.CompletedProcess:
    return warm_start.run(["-m", module, *argv], run_env(), 300, cwd=str(workdir))


def run_all(workdir: Path, module: str, argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Each argv through `module.main`, one after the other in one interpreter in `workdir`."""
    done = warm_start.run(mains_command(module, argvs)[1:], run_env(), 900, cwd=str(workdir))
    return split_mains(module, argvs, done)


@pytest.fixture(scope="module")
def trained(workdir) -> dict[str, subprocess.CompletedProcess]:
    """The debug files' two-step runs, name -> its run."""
    argvs = [["--config", f"{name}_local.toml", "--training.steps", "2", *SHORT] for name in TRAINED]
    return dict(zip(TRAINED, run_all(workdir, "titanlite.train", argvs)))


def notes(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("titanlite: note: ")]


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a refused run prints (exit code 2, nothing else on stderr)."""
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_the_fixtures_are_every_llama3_qwen3_and_deepseek_v3_file():
    names = {path.stem for path in CONFIGS.glob("*.toml")}
    assert names == {*PLANNED, *TRAINED, *ABSENT}
    for name in (*PLANNED, *TRAINED):
        assert sum(line in (CONFIGS / f"{name}.toml").read_text() for line in DOWNLOADS.values()) == 1, name


@pytest.mark.timeout(600)
def test_torchtitans_files_stop_only_at_their_download(workdir):
    names = [*PLANNED, *TRAINED]
    # async TP comes first in the 405B file: titanlite has none (the `_sync` copy has it off)
    files = [f"{name}_sync.toml" if name == "llama3_405b" else f"{name}.toml" for name in names]
    results = run_all(workdir, "titanlite.config.load", [["--config", file] for file in [*files, "llama3_405b.toml"]])
    for name, result in zip(names, results):
        text = (CONFIGS / f"{name}.toml").read_text()
        dataset = next(dataset for dataset, line in DOWNLOADS.items() if line in text)
        line = error_line(result)
        assert line.startswith(f"titanlite: error: training.dataset: '{dataset}' is a dataset torchtitan downloads"), (
            name,
            line,
        )
        assert "python -m titanlite.data.prepare" in line
    line = error_line(results[-1])
    assert line.startswith("titanlite: error: parallelism.enable_async_tensor_parallel: not supported"), line


@pytest.mark.timeout(900)
def test_the_llama3_debug_file_trains_torchtitans_debugmodel_and_says_what_it_leaves_out(trained):
    result = trained["llama3_debug_model"]
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


@pytest.mark.timeout(900)
def test_the_qwen3_moe_debug_file_trains_torchtitans_64_experts(trained):
    """torchtitan's debugmodel_moe (8 layers, 16 heads of 128, 64 experts top-8 of width 768,
    expert-bias balancing) has 317M parameters, 302M of them experts: about 6 GiB resident with
    AdamW. Its seq_len 4096 (16k tokens a step) would take minutes a step on two cores; seq_len
    128 trains the same model, every layer and the bias update, in about 20 s of CPU."""
    assert_trained_torchtitans_moe(trained, "qwen3_moe_debug", "qwen3", "debugmodel_moe")


@pytest.mark.timeout(900)
def test_the_deepseek_v3_debug_file_trains_torchtitans_debugmodel(trained):
    """torchtitan's debugmodel (6 layers, 16 heads of MLA's published widths, 8 experts top-3 and 2
    shared, expert-bias balancing): 34M parameters; at seq_len 128 two steps take about 30 s of CPU."""
    assert_trained_torchtitans_moe(trained, "deepseek_v3_debug_model", "deepseek_v3", "debugmodel")


def assert_trained_torchtitans_moe(trained: dict, file: str, model: str, flavor: str) -> None:
    """torchtitan's MoE debug `file` trained two steps on torchtitan's `flavor` of `model`, its
    expert load logged, with one note each for the parameter groups and the flavor."""
    result = trained[file]
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"model {model} torchtitan:{flavor}: " in result.stdout, result.stdout[-2000:]
    assert "step     2  loss" in result.stdout and "moe_load" in result.stdout, result.stdout[-2000:]
    said = notes(result)
    for key in (
        f"optimizer.param_groups = [] in {file}_local.toml: torchtitan decays every parameter",
        f"model.flavor = '{flavor}' in {file}_local.toml: the file is torchtitan's",
    ):
        assert sum(key in line for line in said) == 1, (key, said)


@pytest.mark.timeout(600)
def test_the_big_files_plan_on_torchtitans_flavors(workdir):
    argvs = []
    for name, (world, memory, vocab, *layout) in PLANNED.items():
        config = f"{name}_local_sync.toml" if name == "llama3_405b" else f"{name}_local.toml"
        argvs.append(["--config", config, "--world-size", str(world), "--device-memory", memory, "--vocab-size"])
        argvs[-1] += [str(vocab), *layout]
    results = dict(zip(PLANNED, run_all(workdir, "titanlite.plan", argvs)))
    for name, result in results.items():
        assert result.returncode == 0 and "verdict: fits" in result.stdout, (name, result.stdout + result.stderr)
        flavor = (CONFIGS / f"{name}.toml").read_text().split('flavor = "')[1].split('"')[0]
        assert f"model: {name.rsplit('_', 1)[0]} torchtitan:{flavor}, " in result.stdout, result.stdout
        assert sum(f"model.flavor = '{flavor}'" in line for line in notes(result)) == 1, result.stderr
    # torchtitan's 8B is the published one
    assert "model: llama3 torchtitan:8B, 8,030,261,248 parameters" in results["llama3_8b"].stdout
    assert "activation checkpointing selective (per op)" in results["llama3_8b"].stdout


@pytest.mark.parametrize("name", ABSENT)
def test_a_family_titanlite_lacks_is_named_first(workdir, name):
    """Its files set options (downloads, its own model keys) that would otherwise be refused first."""
    family = name.removesuffix("_debug_model")
    line = error_line(run(workdir, "titanlite.config", "--config", f"{name}.toml"))
    lacks = (
        "a torchtitan file of a family whose torchtitan flavors" if family == "gpt_oss" else "a torchtitan model family"
    )
    assert line.startswith(f"titanlite: error: model.name: '{family}' in {name}.toml is {lacks}"), line


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
