"""The trainer as a user runs it: real torchrun/gloo processes, real files, real output.

Three things a new user meets first, checked end to end through the launcher:

1. A short 2-process run prints one line per step from rank 0 only, and TensorBoard
   holds the same numbers.
2. `./run_train.sh` (the script itself) trains the debug model when no config is given.
3. Every mistake a user can make on the command line (typo, wrong type, missing file,
   bad tokenizer, empty dataset, impossible mesh) ends with exit code 2 and exactly one
   `titanlite: error:` line naming what is wrong, no traceback, and no process left behind.

Every command runs with a hard timeout and no leftovers (tests/helpers/commands.py).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as titanlite.config uses there
    import tomli as tomllib

from tests.helpers.commands import (
    TEST_TIMEOUT,
    assert_one_line_user_error,
    launch,
    printed_tolerance,
    printed_value,
    run_command,
    step_lines,
    train_single_process,
)
from tests.helpers.distributed import REPO, read_tensorboard, run_env

# Printed field -> TensorBoard tag (metrics.MetricsLogger.log).
TB_TAG_OF_FIELD = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "tps": "tps",
    "mfu": "mfu",
    "mem": "memory_gib",
}


# --------------------------------------------------------------------------------------
# 1. A real 2-process run: log lines and TensorBoard
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_process_run_logs_each_step_once_and_to_tensorboard(tmp_path):
    """What a user sees: one line per step from rank 0, and the same numbers in TensorBoard."""
    steps = 4
    run = launch(
        2,
        [
            "--config",
            "debug_model",
            "--training.steps",
            str(steps),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--metrics.log_freq",
            "1",
            "--job.dump_folder",
            str(tmp_path),
        ],
    )
    assert run.returncode == 0, run.describe()
    assert "Traceback" not in run.output, run.describe()

    lines = step_lines(run)
    assert [int(m["step"]) for m in lines] == list(range(1, steps + 1)), (
        f"expected one line per step from rank 0 only\n{run.describe()}"
    )
    for match in lines:
        assert math.isfinite(float(match["loss"])), match.group(0)
        assert math.isfinite(float(match["grad_norm"])), match.group(0)

    event_files = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, f"expected TensorBoard events from rank 0 only, got {event_files}"
    scalars = read_tensorboard(tmp_path / "tb")
    for printed_field, tag in TB_TAG_OF_FIELD.items():
        assert tag in scalars, f"TensorBoard has no {tag!r} scalar; tags: {sorted(scalars)}"
        logged = dict(scalars[tag])
        assert sorted(logged) == list(range(1, steps + 1)), f"{tag}: logged at steps {sorted(logged)}"
        for match in lines:
            text = match[printed_field]
            expected = printed_value(text)
            value = logged[int(match["step"])]
            tolerance = printed_tolerance(text) + 1e-6 * abs(expected)  # TensorBoard stores float32
            assert abs(value - expected) <= tolerance, (
                f"{tag} at step {match['step']}: TensorBoard {value}, printed {text}"
            )


# --------------------------------------------------------------------------------------
# 2. ./run_train.sh itself
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT)
def test_run_train_script_trains_the_debug_model_by_default(tmp_path):
    """The README's first command: the real script, no --config, picks debug_model.toml."""
    debug_config = tomllib.loads((REPO / "train_configs" / "debug_model.toml").read_text())
    run = run_command(
        [
            str(REPO / "run_train.sh"),
            "--training.steps",
            "2",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--job.dump_folder",
            str(tmp_path),
            "--job.print_config",
            "true",
        ],
        {**run_env(), "NPROC": "2"},
    )
    assert run.returncode == 0, run.describe()
    assert [int(m["step"]) for m in step_lines(run)] == [1, 2], run.describe()
    assert debug_config["job"]["description"] in run.output, (
        f"debug_model.toml was not the config used\n{run.describe()}"
    )


def test_run_train_script_trains_a_pipeline(tmp_path):
    """`NPROC=2 ./run_train.sh --parallelism.pipeline_parallel_degree 2`: two stages of the
    default model, one step line each from rank 0 (the loss comes from rank 1's last stage)."""
    run = run_command(
        [
            str(REPO / "run_train.sh"),
            "--training.steps",
            "2",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--job.dump_folder",
            str(tmp_path),
        ],
        {**run_env(), "NPROC": "2"},
    )
    assert run.returncode == 0, run.describe()
    assert "pipeline Interleaved1F1B: 4 stages on 2 ranks, 4 microbatches per schedule step" in run.output, (
        run.describe()
    )
    lines = step_lines(run)
    assert [int(m["step"]) for m in lines] == [1, 2] and all(math.isfinite(float(m["loss"])) for m in lines), (
        run.describe()
    )


# --------------------------------------------------------------------------------------
# 3. Bad input: exit code 2 and one line, through the launcher and on one plain process
# --------------------------------------------------------------------------------------

# Keeps a run short if a case wrongly gets past its check.
SMALL_RUN = {
    "training.steps": "1",
    "training.seq_len": "64",
    "training.local_batch_size": "2",
    "metrics.enable_tensorboard": "false",
}
GARBAGE_TOKENIZER = "{garbage_tokenizer}"
EMPTY_FOLDER = "{empty_folder}"
LLAMA_8B_TOKENIZER = tomllib.loads((REPO / "train_configs" / "llama_8b.toml").read_text())["model"]["tokenizer_path"]


@dataclass(frozen=True)
class BadInput:
    """One mistake: the overrides that make it and what the error line must name."""

    nproc: int
    overrides: dict[str, str]
    mentions: list[str]
    config: str = "debug_model"
    single_process: bool = True  # also tried as `python -m titanlite.train` (cheap: fails before any training)
    # Through the launcher too: the mesh cases, and one mistake of each stage (the config
    # itself, before torch is imported; a file the plan reads, after). What the launcher
    # adds (rank 0 alone speaks, every rank exits, the exit code passes through) does not
    # depend on which mistake of a stage it is.
    launcher: bool = False
    needs_missing: list[str] = field(default_factory=list)  # repo-relative files this case expects to be absent


TP = "parallelism.tensor_parallel_degree"
BAD_INPUTS = {
    "key_typo": BadInput(2, {"training.stepz": "3"}, ["training.stepz", "training.steps"]),
    "string_for_int": BadInput(2, {"training.steps": "abc"}, ["training.steps", "abc"], launcher=True),
    "missing_config_file": BadInput(2, {}, ["nope.toml"], config="nope.toml"),
    "missing_tokenizer": BadInput(
        2, {"model.tokenizer_path": "/nonexistent/tok.model"}, ["model.tokenizer_path", "/nonexistent/tok.model"]
    ),
    "garbage_tokenizer": BadInput(
        2, {"model.tokenizer_path": GARBAGE_TOKENIZER}, ["model.tokenizer_path", GARBAGE_TOKENIZER], launcher=True
    ),
    "empty_dataset_folder": BadInput(
        2, {"training.dataset": "files", "training.dataset_path": EMPTY_FOLDER}, ["training.dataset_path", EMPTY_FOLDER]
    ),
    "seq_len_zero": BadInput(2, {"training.seq_len": "0"}, ["training.seq_len"]),
    "llama_8b_preset_without_tokenizer": BadInput(
        2, {}, ["model.tokenizer_path", LLAMA_8B_TOKENIZER], config="llama_8b.toml", needs_missing=[LLAMA_8B_TOKENIZER]
    ),
    # The mesh cases need several processes to mean anything, so they only run through the launcher
    # (a world that tp does not divide: test_bad_input.py).
    "heads_not_divisible_by_tp": BadInput(
        3,
        {TP: "3", "training.seq_len": "63"},
        ["tensor_parallel_degree", "n_heads"],
        single_process=False,
        launcher=True,
    ),
    "seq_len_not_divisible_by_tp": BadInput(
        2,
        {TP: "2", "training.seq_len": "63"},
        ["training.seq_len", "tensor_parallel_degree"],
        single_process=False,
        launcher=True,
    ),
}


def bad_input_argv(case: BadInput, tmp_path: Path) -> tuple[list[str], list[str]]:
    """The command-line arguments of `case` and the texts its error must name, with the
    placeholders filled by real files: a tokenizer of random bytes and an empty folder."""
    for relative in case.needs_missing:
        if (REPO / relative).exists():
            pytest.skip(f"{relative} exists on this machine, so this preset does not fail here")
    garbage = tmp_path / "garbage" / "tokenizer.model"
    garbage.parent.mkdir()
    garbage.write_bytes(random.Random(0).randbytes(4096))
    empty = tmp_path / "empty_dataset"
    empty.mkdir()

    def fill(text: str) -> str:
        return text.replace(GARBAGE_TOKENIZER, str(garbage)).replace(EMPTY_FOLDER, str(empty))

    argv = ["--config", case.config]
    for key, value in {**SMALL_RUN, **case.overrides}.items():
        argv += [f"--{key}", fill(value)]
    argv += ["--job.dump_folder", str(tmp_path / "out")]
    return argv, [fill(text) for text in case.mentions]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("name", [name for name, case in BAD_INPUTS.items() if case.launcher])
def test_bad_input_through_launcher_is_one_line_and_exit_2(name, tmp_path):
    """Each rank meets the mistake; rank 0 alone says so in one line and every rank exits."""
    case = BAD_INPUTS[name]
    argv, mentions = bad_input_argv(case, tmp_path)
    assert_one_line_user_error(launch(case.nproc, argv), mentions)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("name", [name for name, case in BAD_INPUTS.items() if case.single_process])
def test_bad_input_on_one_plain_process_is_one_line_and_exit_2(name, tmp_path):
    """The same mistakes without torchrun: `python -m titanlite.train` is a world of one."""
    argv, mentions = bad_input_argv(BAD_INPUTS[name], tmp_path)
    assert_one_line_user_error(train_single_process(argv), mentions)
