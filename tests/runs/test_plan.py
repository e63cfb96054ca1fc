"""The dry-run planner (`python -m titanlite.plan`): exact per-rank shares of the 70B and
405B presets at 512 ranks, the figures in the presets' comments (Llama's and Qwen3's, MoE
included) and in docs/planning.md (pipelined layouts included) equal to what it prints, the
materialized rank's memory, refused layouts, the trainer's own config errors, and the debug
model's figures against a real run's (a
pipeline's stages included)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import REPO, run_env, run_mains, run_ranks
from tests.helpers.hf_models import with_hf_folders
from tests.runs.equivalence import HF_MODEL, LORA, QWEN3_MOE

# A hang guard: the presets test plans 31 layouts in 60-100 s alone, over 300 s beside two busy
# workers on a slow host.
TIMEOUT_S = 600
VOCAB = ["--vocab-size", "128256"]  # the presets' tokenizer is not shipped


def plan(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.plan", *args]
    return subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def plans(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Several planner runs in one interpreter, each through `titanlite.plan.main` (what
    `python -m titanlite.plan` calls) with its own stdout, stderr and exit code: the imports
    (~5 s of CPU a process) are paid once. Each run joins its own fake world, replacing the
    previous one."""
    return run_mains("titanlite.plan", list(argvs), TIMEOUT_S)


def figures(stdout: str) -> dict[str, float]:
    """The exact byte counts and the estimates (GiB) of a planner report."""
    out = {}
    for name in ("parameters", "gradients", "optimizer", "buffers"):
        out[name] = int(re.search(rf"^  {name} .*?([\d,]+) bytes", stdout, re.M).group(1).replace(",", ""))
    out["elements"] = int(re.search(r"bytes: ([\d,]+) elements", stdout).group(1).replace(",", ""))
    trained = re.search(r"elements of the local shards, ([\d,]+) trained", stdout)
    out["trained"] = int(trained.group(1).replace(",", "")) if trained else out["elements"]
    for name in ("activations", "FSDP gathered", "total"):
        match = re.search(rf"^  {name} +([\d.,]+) GiB", stdout, re.M)
        out[name] = float(match.group(1).replace(",", "")) * 2**30 if match else 0.0
    return out


def test_census_agrees_with_building_the_least_rank():
    """The every-rank count names the rank holding least (uneven vocabulary split); building
    that rank for real gives the same count."""
    args = [
        "--config",
        "debug_model",
        "--world-size",
        "16",
        "--vocab-size",
        "1000",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]
    result = plan(*args)
    assert result.returncode == 0, result.stderr
    least, rank = re.search(r"shards: ranks hold ([\d,]+) \(rank (\d+)\)", result.stdout).groups()
    assert rank != "0" and "= the model's" in result.stdout
    built = plan(*args, "--rank", rank)
    assert figures(built.stdout)["elements"] == int(least.replace(",", ""))


VERDICTS = {
    "70b_on_8": (
        ["--config", "llama_70b", "--world-size", "8"],
        "does not fit",
    ),  # tp 8 alone: 131 GiB of fp32 state a rank
    "8b_on_1": (["--config", "llama_8b", "--world-size", "1"], "does not fit"),  # 8B on one GPU
    "8b_on_8": (["--config", "llama_8b", "--world-size", "8"], "fits"),
}
REFUSALS = {
    "tp_over_kv_heads": (
        ["--config", "llama_405b", "--world-size", "512", *VOCAB, "--parallelism.tensor_parallel_degree", "16"],
        "parallelism.tensor_parallel_degree: n_kv_heads 8 is not divisible by tensor_parallel_degree 16",
    ),
    "no_tokenizer": (
        ["--config", "llama_70b", "--world-size", "512"],
        "model.tokenizer_path: tokenizer file not found: assets/tokenizer/llama/tokenizer.model; or plan without it: "
        "--vocab-size N",
    ),
    "world_not_divisible": (
        ["--config", "debug_model", "--world-size", "3", "--parallelism.tensor_parallel_degree", "2"],
        "parallelism: world size 3 is not divisible by data_parallel_replicate_degree 1 x tensor_parallel_degree 2",
    ),
    "rank_outside": (
        ["--config", "debug_model", "--world-size", "2", "--rank", "2"],
        "--rank 2 is not a rank of --world-size 2",
    ),
    "memory_without_unit": (
        ["--config", "debug_model", "--world-size", "2", "--device-memory", "80"],
        "--device-memory: expected a size with a unit",
    ),
}


@pytest.fixture(scope="module")
def small_plans() -> dict[str, subprocess.CompletedProcess]:
    """The verdict and refusal cases, run in one interpreter."""
    argvs = {name: [*args, *VOCAB] for name, (args, _) in VERDICTS.items()} | {
        name: args for name, (args, _) in REFUSALS.items()
    }
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
    trainer = subprocess.run(
        [sys.executable, "-m", "titanlite.train", *bad],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
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
    assert re.search(r"^shards: every rank holds [\d,]+ parameters; summed over all 2 ranks", result.stdout, re.M), (
        result.stdout
    )


PUBLISHED = {"llama_70b": 70_553_706_496, "llama_405b": 405_853_388_800}
# (dim, layers, ffn hidden, kv width) of the published flavors
SHAPES = {"llama_70b": (8192, 80, 28672, 1024), "llama_405b": (16384, 126, 53248, 1024)}


def rank0_elements(config: str, dp: int, tp: int, vocab: int = 128256) -> int:
    """Rank 0's share worked out by hand: every matrix splits evenly except the vocabulary
    (FSDP chunks the tp shard's rows, rounding up); norms are replicated across tp."""
    d, layers, f, kv = SHAPES[config]
    vocab_rows = math.ceil(vocab / tp / dp)
    per_layer = (2 * d * d + 2 * kv * d + 3 * d * f) // (dp * tp) + 2 * d // dp
    return 2 * vocab_rows * d + layers * per_layer + d // dp


@pytest.mark.parametrize("config", ["llama_70b", "llama_405b"])
def test_presets_at_512_ranks_fit_with_exact_shares(config):
    """dp_shard 64 x tp 8, as both presets recommend (405B's 8 kv heads cap tp at 8)."""
    result = plan("--config", config, "--world-size", "512", *VOCAB)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "world: 512 = dp_shard 64 x tp 8; rank 0 (dp_shard 0, tp 0)" in out
    counts = figures(out)
    assert counts["elements"] == rank0_elements(config, 64, 8)
    assert (
        counts["parameters"] == counts["gradients"] == 4 * counts["elements"]
        and counts["optimizer"] == 2 * counts["parameters"]
    )
    total = f"{PUBLISHED[config]:,}"
    assert f"summed over all 512 ranks, each replicated tensor once: {total} = the model's {total}" in out
    assert re.search(r"^verdict: fits: [\d.]+ GiB of 80.00 GiB, [\d.]+ GiB \(\d+%\) to spare$", out, re.M)


def test_materialized_70b_rank_costs_its_shard():
    """Rank 0 of 70B on 512 ranks allocates and initializes only its 1/512: the resident
    memory grows by the planner's parameter + buffer bytes, within 20%."""
    result = plan("--config", "llama_70b", "--world-size", "512", *VOCAB, "--materialize")
    assert result.returncode == 0, result.stderr
    match = re.search(r"materialized rank 0: allocated and initialized in [\d.]+ s .*\(ratio ([\d.]+)\)", result.stdout)
    assert match, result.stdout
    assert 0.8 <= float(match.group(1)) <= 1.2


# A preset comment's layout line: "512 GPUs, pp 8 x dp_shard 8 x tp 8, local_batch_size 16:  fits, 30.88 GiB".
PRESET_LINE = re.compile(r"^#\s+(\d+) GPUs?,?\s*([^:]*):\s+(fits|does not fit), ([\d.]+) GiB", re.M)
LAYOUT_KEYS = {
    "pp": "parallelism.pipeline_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "etp": "parallelism.expert_tensor_parallel_degree",
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "local_batch_size": "training.local_batch_size",
    "seq_len": "training.seq_len",
}


# Each preset's vocabulary as its comments plan it: Llama 3's tokenizer, Qwen's published
# (padded) embedding. The Qwen3 presets say one layout each, one planner run apiece.
PRESET_VOCAB = {
    "llama_8b": "128256",
    "llama_70b": "128256",
    "llama_405b": "128256",
    "qwen3_8b": "151936",
    "qwen3_32b": "151936",
    "qwen3_30b_a3b": "151936",
    "qwen3_235b_a22b": "151936",
    "deepseek_v3_16b": "102400",
    "deepseek_v3_671b": "129280",
    "gpt_oss_20b": "201088",
    "gpt_oss_120b": "201088",
}


def preset_lines() -> list[tuple[str, list[str], str, str]]:
    """(preset, planner argv, verdict, GiB) of every layout line in the presets' comments."""
    found = []
    for preset, vocab in PRESET_VOCAB.items():
        for world, layout, verdict, gib in PRESET_LINE.findall((REPO / "train_configs" / f"{preset}.toml").read_text()):
            argv = ["--config", preset, "--world-size", world, "--vocab-size", vocab]
            for key, value in re.findall(r"\b(pp|tp|cp|ep|etp|dp_replicate|local_batch_size|seq_len) (\d+)", layout):
                argv += [f"--{LAYOUT_KEYS[key]}", value]
            found.append((preset, argv, verdict, gib))
    return found


def test_the_presets_comments_and_planning_md_say_what_the_planner_prints():
    """Every layout line of the presets' comments (pipelined ones included) is the planner's
    verdict and rank 0's total to two decimals, and docs/planning.md's sample is its output."""
    lines = preset_lines()
    assert len(lines) >= 14 and sum("--parallelism.pipeline_parallel_degree" in argv for _, argv, _, _ in lines) >= 3
    qwen3 = [argv for preset, argv, verdict, _ in lines if preset.startswith("qwen3") and verdict == "fits"]
    assert len(qwen3) == 11 and all(int(argv[argv.index("--world-size") + 1]) >= 512 for argv in qwen3)
    assert sum("--parallelism.expert_parallel_degree" in argv for argv in qwen3) == 7
    assert sum("--parallelism.expert_tensor_parallel_degree" in argv for argv in qwen3) == 2  # etp of each MoE preset
    ep_hsdp = [
        argv
        for argv in qwen3
        if {"--parallelism.expert_parallel_degree", "--parallelism.data_parallel_replicate_degree"} <= {*argv}
    ]
    assert len(ep_hsdp) == 2  # ep x HSDP of each MoE preset
    assert sum("--parallelism.context_parallel_degree" in argv for _, argv, _, _ in lines) >= 3
    doc = (REPO / "docs" / "planning.md").read_text()
    sample_command = re.search(r"```bash\npython -m titanlite.plan (.*)\n```\n\n```\n(.*?)```", doc, re.S)
    results = plans(*(argv for _, argv, _, _ in lines), sample_command.group(1).split())
    for (preset, argv, verdict, gib), result in zip(lines, results):
        said = re.search(r"^verdict: (fits|does not fit): ([\d.]+) GiB", result.stdout, re.M)
        assert said and (said.group(1), said.group(2)) == (verdict, gib), (
            f"{preset} {argv}: comment {verdict}, {gib} GiB; planner {said and said.groups()}"
        )
        if preset in (
            "qwen3_30b_a3b",
            "qwen3_235b_a22b",
        ):  # 128 experts over 512 ranks: an equal block each (fsdp.shard_dim, with ep fsdp.expert_shard_dim)
            held = re.search(r"ranks hold ([\d,]+) \(rank \d+\) to ([\d,]+)|every rank holds ([\d,]+)", result.stdout)
            least, most = (int(n.replace(",", "")) for n in (held.groups()[:2] if held[1] else held.groups()[2:] * 2))
            assert most < 1.02 * least, f"{preset}: ranks hold {least:,} to {most:,} parameters"
    assert results[-1].stdout == sample_command.group(2), "docs/planning.md's sample is not the planner's output"


# The real runs the planner's figures are checked against: name -> (processes, layout).
MEASURED = {
    "1": (1, []),
    "2": (2, []),
    "4": (4, []),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "moe_ep2": (2, [*QWEN3_MOE, "--parallelism.expert_parallel_degree", "2"]),
    "moe_ep2_hsdp2x2": (
        4,
        [*QWEN3_MOE, "--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2"],
    ),
    "moe_etp2_tp2": (
        2,
        [*QWEN3_MOE, "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"],
    ),
    "deepseek_v3": (2, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_q_lora"]),
    "gpt_oss": (2, ["--model.name", "gpt_oss"]),
    # Any transformers causal LM (`--model.name hf`): a dense one, and an MoE one whose sparse
    # blocks are titanlite's MoE layer, at ep 2.
    "hf_llama": (2, [*HF_MODEL, "hf:llama"]),
    "hf_mixtral_ep2": (2, [*HF_MODEL, "hf:mixtral", "--parallelism.expert_parallel_degree", "2"]),
    # LoRA: gradients and optimizer state for the adapters alone, under TP laid out like their base.
    "lora_tp2": (2, [*LORA, "--parallelism.tensor_parallel_degree", "2"]),
}
MEASURED_ARGS = [
    "--config",
    "debug_model",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.enable_tensorboard",
    "false",
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[dict[str, list[dict]], Path]:
    """Each of MEASURED's runs: every rank's bytes and step peak (tests/helpers/memory_worker.py),
    the runs of one world size one after another in one set of new interpreters (a fork's heap
    holds its server's freed memory, which a step would reuse unseen). Freed tensors' pages go
    back, so RSS follows live tensors: every block over 64 KiB its own mapping (glibc's default
    count of mappings, not the launcher's 0) and the heap trimmed."""
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_MMAP_MAX_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
    worker = str(REPO / "tests" / "helpers" / "memory_worker.py")
    folder = tmp_path_factory.mktemp("measured")
    results = {}
    for nproc in sorted({n for n, _ in MEASURED.values()}):
        cases = {
            name: with_hf_folders([*MEASURED_ARGS, *layout, "--job.dump_folder", str(folder / name)], folder)
            for name, (n, layout) in MEASURED.items()
            if n == nproc
        }
        (folder / f"cases{nproc}.json").write_text(json.dumps(cases))
        out = folder / f"world{nproc}.json"
        result = run_ranks(
            nproc, [worker, str(out), str(folder / f"cases{nproc}.json")], [], TIMEOUT_S, env, fresh=True
        )
        assert result.returncode == 0, result.stderr[-3000:]
        results.update(json.loads(out.read_text()))
    return results, folder


@pytest.mark.parametrize("name", MEASURED)
def test_debug_model_figures_match_a_real_run(name, measured):
    """Every rank's parameter, gradient and AdamW bytes equal what the trainer holds (each
    pipeline stage's its own), and the estimated step working set (activations + FSDP
    buffers) is within 30% of the measured peak of a training step above everything else
    the process holds."""
    nproc, layout = MEASURED[name]
    runs, folder = measured
    args = with_hf_folders([*MEASURED_ARGS, *layout], folder)
    reports = plans(*([*args, "--world-size", str(nproc), "--rank", str(rank)] for rank in range(nproc)))
    for rank, (real, report) in enumerate(zip(runs[name], reports)):
        planned = figures(report.stdout)
        assert (planned["parameters"], planned["gradients"], planned["optimizer"]) == (
            real["param_bytes"],
            real["grad_bytes"],
            real["optim_bytes"],
        )
        assert planned["trained"] * 4 == real["trained_param_bytes"]  # float32
        estimate = planned["activations"] + planned["FSDP gathered"]
        if (
            "--parallelism.pipeline_parallel_degree" in layout
        ):  # a stage's step: its gradients (allocated by the step) weigh as much as its few microbatches' activations
            estimate += planned["gradients"]
        assert estimate == pytest.approx(real["step_peak_bytes"], rel=0.3), (
            f"rank {rank}: {estimate:,.0f} vs {real['step_peak_bytes']:,}"
        )


def test_the_sft_lora_preset_plans_as_its_comment_says_on_qwen3_8b_config(tmp_path):
    """train_configs/qwen3_8b_sft_lora.toml on a folder holding Qwen3-8B's config.json (written
    by titanlite's adapter from the published shape): the planner's verdict and total are its
    comment's, and the ranks' trained elements add up to the count the comment states."""
    from titanlite.models import get_model_spec

    spec = get_model_spec("qwen3", "8B")
    (tmp_path / "config.json").write_text(json.dumps(spec.hf_adapter.hf_config(spec.args_for("8B", 151936))))
    text = (REPO / "train_configs" / "qwen3_8b_sft_lora.toml").read_text()
    [(world, _, verdict, gib)] = PRESET_LINE.findall(text)
    argv = ["--config", "qwen3_8b_sft_lora", "--world-size", world, "--vocab-size", "151665"]
    [report] = plans([*argv, "--model.hf_assets_path", str(tmp_path), "--checkpoint.initial_load_path", str(tmp_path)])
    assert report.returncode == 0, report.stderr[-2000:]
    assert f"verdict: {verdict}: {gib} GiB" in report.stdout
    trained = int(re.search(r"([\d,]+) trained", report.stdout).group(1).replace(",", ""))
    stated = int(re.search(r"([\d,]+) parameters are trained", text).group(1).replace(",", ""))
    assert trained * int(world) == stated == 36 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288))
