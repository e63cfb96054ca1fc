"""The dry-run planner (`python -m titanlite.plan`): exact per-rank shares of the 70B and
405B presets at 512 ranks, the figures in the presets' comments and in docs/planning.md (pipelined
layouts included) equal to what it prints, the materialized rank's memory, refused layouts,
the trainer's own config errors, and the debug model's figures against a real run's (a
pipeline's stages included)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.distributed import REPO, run_env, run_mains, run_ranks

TIMEOUT_S = 300  # generous: several test suites share 2 cores
VOCAB = ["--vocab-size", "128256"]  # the presets' tokenizer is not shipped


def plan(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.plan", *args]
    return subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def plans(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Several planner runs in one interpreter, each through `titanlite.plan.main` (what
    `python -m titanlite.plan` calls) with its own stdout, stderr and exit code: the imports
    (~5 s of CPU a process) are paid once. Each run joins its own fake world, replacing the
    previous one, as the planner's census does for every rank."""
    return run_mains("titanlite.plan", list(argvs), TIMEOUT_S)


def figures(stdout: str) -> dict[str, float]:
    """The exact byte counts and the estimates (GiB) of a planner report."""
    out = {}
    for name in ("parameters", "gradients", "optimizer", "buffers"):
        out[name] = int(re.search(rf"^  {name} .*?([\d,]+) bytes", stdout, re.M).group(1).replace(",", ""))
    out["elements"] = int(re.search(r"bytes: ([\d,]+) elements", stdout).group(1).replace(",", ""))
    for name in ("activations", "FSDP gathered", "total"):
        match = re.search(rf"^  {name} +([\d.,]+) GiB", stdout, re.M)
        out[name] = float(match.group(1).replace(",", "")) * 2**30 if match else 0.0
    return out


def test_census_agrees_with_building_the_least_rank():
    """The every-rank count names the rank holding least (uneven vocabulary split); building
    that rank for real gives the same count."""
    args = ["--config", "debug_model", "--world-size", "16", "--vocab-size", "1000", "--parallelism.tensor_parallel_degree", "2"]
    result = plan(*args)
    assert result.returncode == 0, result.stderr
    least, rank = re.search(r"shards: ranks hold ([\d,]+) \(rank (\d+)\)", result.stdout).groups()
    assert rank != "0" and "= the model's" in result.stdout
    built = plan(*args, "--rank", rank)
    assert figures(built.stdout)["elements"] == int(least.replace(",", ""))


VERDICTS = {
    "70b_on_8": (["--config", "llama_70b", "--world-size", "8"], "does not fit"),  # tp 8 alone: 131 GiB of fp32 state a rank
    "8b_on_1": (["--config", "llama_8b", "--world-size", "1"], "does not fit"),  # 8B on one GPU
    "8b_on_8": (["--config", "llama_8b", "--world-size", "8"], "fits"),
}
REFUSALS = {
    "tp_over_kv_heads": (["--config", "llama_405b", "--world-size", "512", *VOCAB, "--parallelism.tensor_parallel_degree", "16"],
                         "parallelism.tensor_parallel_degree: n_kv_heads 8 is not divisible by tensor_parallel_degree 16"),
    "no_tokenizer": (["--config", "llama_70b", "--world-size", "512"],
                     "model.tokenizer_path: tokenizer file not found: assets/tokenizer/llama/tokenizer.model; or plan without it: --vocab-size N"),
    "world_not_divisible": (["--config", "debug_model", "--world-size", "3", "--parallelism.tensor_parallel_degree", "2"],
                            "parallelism: world size 3 is not divisible by data_parallel_replicate_degree 1 x tensor_parallel_degree 2"),
    "rank_outside": (["--config", "debug_model", "--world-size", "2", "--rank", "2"], "--rank 2 is not a rank of --world-size 2"),
    "memory_without_unit": (["--config", "debug_model", "--world-size", "2", "--device-memory", "80"], "--device-memory: expected a size with a unit"),
}  # fmt: skip


@pytest.fixture(scope="module")
def small_plans() -> dict[str, subprocess.CompletedProcess]:
    """The verdict and refusal cases, run in one interpreter."""
    argvs = {name: [*args, *VOCAB] for name, (args, _) in VERDICTS.items()} | {name: args for name, (args, _) in REFUSALS.items()}
    return dict(zip(argvs, plans(*argvs.values())))


@pytest.mark.parametrize("name", VERDICTS)
def test_verdict_and_exit_code(name, small_plans):
    result, verdict = small_plans[name], VERDICTS[name][1]
    assert result.returncode == (0 if verdict == "fits" else 1), result.stderr
    assert re.search(rf"^verdict: {verdict}: ", result.stdout, re.M)


@pytest.mark.parametrize("name", REFUSALS)
def test_refusals_are_one_line_and_exit_2(name, small_plans):
    result, message = small_plans[name], REFUSALS[name][1]
    assert result.returncode == 2
    assert result.stderr.startswith(f"titanlite: error: {message}") and result.stderr.count("\n") == 1, result.stderr


def test_config_errors_are_the_trainers():
    bad = ["--config", "debug_model", "--training.steps", "0"]
    trainer = subprocess.run([sys.executable, "-m", "titanlite.train", *bad], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    planner = plan(*bad, "--world-size", "2")
    assert trainer.returncode == planner.returncode == 2
    assert planner.stderr == trainer.stderr and planner.stderr.startswith("titanlite: error: training.steps")


def test_device_memory_sources():
    base = ["--config", "debug_model", "--world-size", "1"]
    default, h200, tiny = plans(base, [*base, "--gpu", "H200"], [*base, "--device-memory", "256MiB"])
    assert "device: 80.00 GiB (H100, the default; --gpu or --device-memory to change)" in default.stdout
    assert "device: 140.00 GiB (--gpu H200)" in h200.stdout
    assert tiny.returncode == 1 and "device: 0.25 GiB (--device-memory)" in tiny.stdout


def test_equal_shares_are_said_once():
    result = plans(["--config", "debug_model", "--world-size", "2"])[0]
    assert re.search(r"^shards: every rank holds [\d,]+ parameters; summed over all 2 ranks", result.stdout, re.M), result.stdout
