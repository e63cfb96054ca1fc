"""The trainer as a user runs it: real torchrun/gloo processes, real files, real output.

Three things a new user meets first, checked end to end through the launcher:

1. A short 2-process run prints one line per step from rank 0 only, and TensorBoard
   holds the same numbers.
2. `./run_train.sh` (the script itself) trains the debug model when no config is given.
3. Every mistake a user can make on the command line (typo, wrong type, missing file,
   bad tokenizer, empty dataset, impossible mesh) ends with exit code 2 and exactly one
   `titanlite: error:` line naming what is wrong, no traceback, and no process left behind.

Every command runs with a hard timeout; on a timeout, or when a worker outlives the launcher,
the test kills the processes it started (found by a marker in their environment) and fails.
"""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as titanlite.config uses there
    import tomli as tomllib

from tests.helpers.distributed import REPO, read_tensorboard, run_env

RUN_TIMEOUT = 180  # seconds per command; generous, other suites may share the 2 cores
TEST_TIMEOUT = RUN_TIMEOUT + 60
MARKER_VAR = "TITANLITE_CLI_TEST_RUN"

# One per-step line, as titanlite/observe/metrics.py writes it (after the logger's timestamp).
STEP_LINE = re.compile(
    r"step +(?P<step>\d+)  loss +(?P<loss>\S+)  grad_norm +(?P<grad_norm>\S+)  lr (?P<lr>\S+)  "
    r"tps (?P<tps>[\d,]+)  mfu (?P<mfu>\S+)%  mem (?P<mem>\S+) GiB$"
)
# Anything that looks like a step line, well formed or not: counts lines from any rank.
ANY_STEP_LINE = re.compile(r"\bstep +\d+ +loss\b")
# Printed field -> TensorBoard tag (metrics.MetricsLogger.log).
TB_TAG_OF_FIELD = {"loss": "loss", "grad_norm": "grad_norm", "lr": "lr", "tps": "tps", "mfu": "mfu", "mem": "memory_gib"}

# What torchrun sets; a plain `python -m titanlite.train` must run without any of it.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------------------
# Running commands with a hard timeout and no leftovers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self) -> str:
        """The command, exit code and output tails, for assertion messages."""
        return (
            f"$ {' '.join(self.command)}\nexit code {self.returncode} after {self.seconds:.1f} s\n"
            f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-5000:]}"
        )


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment carries this run's marker (workers included:
    torchrun starts them in their own sessions, so a process group would miss them)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def kill_marked(marker: str) -> list[int]:
    """SIGKILL every process of this run (only ones this test started) and return their pids."""
    pids = marked_processes(marker)
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return pids


def run_command(command: list[str], env: dict[str, str], timeout: float = RUN_TIMEOUT) -> Run:
    """Run `command` from the repo root; fail the test on a hang or on processes that outlive it."""
    marker = uuid.uuid4().hex
    env = {**env, MARKER_VAR: marker}
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = kill_marked(marker)
        process.kill()
        stdout, stderr = process.communicate()
        run = Run(command, process.returncode, stdout, stderr, time.monotonic() - start)
        pytest.fail(f"did not finish in {timeout} s (killed pids {killed}):\n{run.describe()}")
    run = Run(command, process.returncode, stdout, stderr, time.monotonic() - start)
    deadline = time.monotonic() + 10  # the launcher has returned; its workers must be gone too
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftovers = kill_marked(marker)
    assert not leftovers, f"processes still running after the command exited (killed {leftovers}):\n{run.describe()}"
    return run


def launch(nproc: int, argv: list[str]) -> Run:
    """`python -m titanlite.launch --standalone --nproc-per-node N -m titanlite.train ARGV`."""
    command = [sys.executable, "-m", "titanlite.launch", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "titanlite.train", *argv]
    return run_command(command, run_env())


def train_single_process(argv: list[str]) -> Run:
    """`python -m titanlite.train ARGV` on one plain process, with no torchrun variables set."""
    env = {k: v for k, v in run_env().items() if k not in LAUNCHER_ENV}
    return run_command([sys.executable, "-m", "titanlite.train", *argv], env)


# --------------------------------------------------------------------------------------
# Reading the output
# --------------------------------------------------------------------------------------


def step_lines(run: Run) -> list[re.Match]:
    """The per-step lines, each checked against the documented format."""
    lines = [line for line in run.output.splitlines() if ANY_STEP_LINE.search(line)]
    matches = []
    for line in lines:
        match = STEP_LINE.search(line)
        assert match, f"step line not in the documented format: {line!r}\n{run.describe()}"
        matches.append(match)
    return matches


def printed_tolerance(text: str) -> float:
    """Half a unit in the last printed digit: '8.7363' -> 5e-5, '1.6e-04' -> 5e-6, '1,234' -> 0.5."""
    mantissa, _, exponent = text.replace(",", "").lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def printed_value(text: str) -> float:
    return float(text.replace(",", ""))


def assert_one_line_user_error(run: Run, mentions: list[str]) -> None:
    """Exit code 2, one `titanlite: error:` line naming the problem, no traceback, no
    launcher failure summary on top."""
    assert run.returncode == 2, f"expected exit code 2\n{run.describe()}"
    error_lines = [line for line in run.output.splitlines() if "titanlite: error:" in line]
    assert len(error_lines) == 1, f"expected exactly one 'titanlite: error:' line, got {len(error_lines)}\n{run.describe()}"
    for text in mentions:
        assert text in error_lines[0], f"the error line does not name {text!r}: {error_lines[0]!r}"
    assert "Traceback" not in run.output, f"traceback in the output of a user error\n{run.describe()}"
    assert "titanlite: rank" not in run.output, f"launcher reported a crash for a user error\n{run.describe()}"


# --------------------------------------------------------------------------------------
# 1. A real 2-process run: log lines and TensorBoard
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_process_run_logs_each_step_once_and_to_tensorboard(tmp_path):
    """What a user sees: one line per step from rank 0, and the same numbers in TensorBoard."""
    steps = 4
    run = launch(2, [
        "--config", "debug_model",
        "--training.steps", str(steps),
        "--training.seq_len", "64",
        "--training.local_batch_size", "2",
        "--metrics.log_freq", "1",
        "--job.dump_folder", str(tmp_path),
    ])
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
            assert abs(value - expected) <= tolerance, f"{tag} at step {match['step']}: TensorBoard {value}, printed {text}"


# --------------------------------------------------------------------------------------
# 2. ./run_train.sh itself
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(TEST_TIMEOUT)
def test_run_train_script_trains_the_debug_model_by_default(tmp_path):
    """The README's first command: the real script, no --config, picks debug_model.toml."""
    debug_config = tomllib.loads((REPO / "train_configs" / "debug_model.toml").read_text())
    run = run_command(
        [str(REPO / "run_train.sh"),
         "--training.steps", "2",
         "--training.seq_len", "64",
         "--training.local_batch_size", "2",
         "--job.dump_folder", str(tmp_path),
         "--job.print_config", "true"],
        {**run_env(), "NPROC": "2"},
    )
    assert run.returncode == 0, run.describe()
    assert [int(m["step"]) for m in step_lines(run)] == [1, 2], run.describe()
    assert debug_config["job"]["description"] in run.output, f"debug_model.toml was not the config used\n{run.describe()}"


def test_run_train_script_trains_a_pipeline(tmp_path):
    """`NPROC=2 ./run_train.sh --parallelism.pipeline_parallel_degree 2`: two stages of the
    default model, one step line each from rank 0 (the loss comes from rank 1's last stage)."""
    run = run_command(
        [str(REPO / "run_train.sh"),
         "--training.steps", "2",
         "--training.seq_len", "64",
         "--training.local_batch_size", "4",
         "--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
         "--job.dump_folder", str(tmp_path)],
        {**run_env(), "NPROC": "2"},
    )
    assert run.returncode == 0, run.describe()
    assert "pipeline Interleaved1F1B: 4 stages on 2 ranks, 4 microbatches per schedule step" in run.output, run.describe()
    lines = step_lines(run)
    assert [int(m["step"]) for m in lines] == [1, 2] and all(math.isfinite(float(m["loss"])) for m in lines), run.describe()


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
        3, {TP: "3", "training.seq_len": "63"}, ["tensor_parallel_degree", "n_heads"], single_process=False, launcher=True
    ),
    "seq_len_not_divisible_by_tp": BadInput(
        2, {TP: "2", "training.seq_len": "63"}, ["training.seq_len", "tensor_parallel_degree"], single_process=False, launcher=True
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
