"""titanlite/launch/ on one process: what the launcher puts in CPU workers' environment,
which rank it blames and its one-line endings. The launcher run as a command (its workers,
run_train.sh, the Slurm script): tests/runs/test_launch.py; --cpu-bind's blocks: test_cpu_binding.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from titanlite.errors import COLLECTIVE_FAILURE_EXIT_CODE, ERROR_FILE_ENV, LAUNCHER_PID_ENV, hand_to_launcher
from titanlite.launch import CPU_MALLOC_DEFAULTS, set_cpu_worker_defaults
from titanlite.launch.failures import failure_line, first_failure, restart_line
from titanlite.parallel.distributed import usable_cores


def test_cpu_workers_get_their_share_of_cores_and_a_short_openmp_spin(monkeypatch):
    """What the launcher puts in CPU workers' environment, and that a caller's value wins."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    set_cpu_worker_defaults("2")
    assert os.environ["OMP_NUM_THREADS"] == str(max(1, usable_cores() // 2))
    assert (os.environ["OMP_WAIT_POLICY"], os.environ["GOMP_SPINCOUNT"]) == ("PASSIVE", "1000")
    assert all(os.environ[name] == value for name, value in CPU_MALLOC_DEFAULTS.items())
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    set_cpu_worker_defaults("2")
    assert (os.environ["OMP_NUM_THREADS"], os.environ["GOMP_SPINCOUNT"]) == ("7", "0")


FRESH_TENSORS = """
import resource, torch
def step():  # a training step's pattern: tensors of several sizes made and freed
    held = [torch.empty(n).fill_(1.0) for n in (3 << 20, 2 << 20, 6 << 20, 3 << 20, 1 << 20)]  # 12, 8, 24, 12, 4 MiB
for _ in range(20):  # the heap settles
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


# glibc's own fixed values, as the issue ran them: every block over 128 KiB a fresh mmap.
GLIBC_FIXED = {"MALLOC_MMAP_MAX_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def run_pattern(script: str, extra: dict[str, str]) -> int:
    """What `script` prints, run in a fresh Python whose malloc settings are `extra` only."""
    import subprocess
    import sys

    names = {*CPU_MALLOC_DEFAULTS, *GLIBC_FIXED, "GLIBC_TUNABLES"}
    env = {k: v for k, v in os.environ.items() if k not in names} | extra
    return int(
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    )


def test_cpu_workers_reuse_freed_memory_instead_of_faulting_it_in_again():
    """The allocator defaults' effect: ten steps of tensors made and freed (60 MiB a step)
    fault in most pages every step under glibc's fixed values (a fresh mmap per block), and
    almost none with the workers' settings once the heap has settled (it keeps the blocks)."""
    pages = 10 * (60 << 20) // 4096
    assert run_pattern(FRESH_TENSORS, GLIBC_FIXED) > 0.5 * pages
    assert run_pattern(FRESH_TENSORS, CPU_MALLOC_DEFAULTS) < 0.05 * pages


LARGE_BLOCK_RETURNED = """
import re, torch
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
held = [torch.empty(n).fill_(1.0) for n in (1 << 20, 2 << 20)]  # the heap in use
large = torch.empty(64 << 20).fill_(1.0)  # 256 MiB: an FSDP unit's gathered weights
before = rss()
del large
print(before - rss())
"""


def test_cpu_workers_give_back_a_freed_block_of_32_mib_or_more():
    """Blocks from 32 MiB up are mapped and returned on free under the workers' settings: kept
    in the heap (issue 36: MALLOC_MMAP_MAX_=0), their holes made an MoE model's heap outgrow one
    process's."""
    assert run_pattern(LARGE_BLOCK_RETURNED, CPU_MALLOC_DEFAULTS) > 200 << 20
    assert (
        run_pattern(LARGE_BLOCK_RETURNED, {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}) < 8 << 20
    )


def failure(local_rank: int, exitcode: int, timestamp: int, said: Path | None = None) -> ProcessFailure:
    """A worker's failure as the agent reports it; `said`: the error file it handed over."""
    made = ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file=str(said or ""))
    made.timestamp = timestamp
    return made


def handed(tmp_path: Path, monkeypatch, rank: int, line: str) -> Path:
    """The error file a worker under titanlite.launch leaves (errors.hand_to_launcher)."""
    path = tmp_path / f"error-{rank}.json"
    monkeypatch.setenv(LAUNCHER_PID_ENV, "1")
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    assert hand_to_launcher(line)
    return path


def test_the_killed_rank_is_named_not_the_ranks_that_failed_because_of_it():
    """rank 1 killed; rank 0's collective failed in the same second and was seen first
    (torchrun's timestamps are whole seconds); rank 2 was stopped by the agent."""
    failures = {
        0: failure(0, COLLECTIVE_FAILURE_EXIT_CODE, 100),
        1: failure(1, -signal.SIGKILL, 100),
        2: failure(2, -signal.SIGTERM, 100),
    }
    assert first_failure(failures)[0] == 1
    line, code = failure_line(failures)
    assert line == "titanlite: rank 1 failed first (killed by signal SIGKILL); 2 other rank(s) stopped after it"
    assert code == 1


def test_the_earliest_cause_wins_then_the_order_seen():
    failures = {0: failure(0, 1, 101), 3: failure(3, 1, 100), 1: failure(1, -signal.SIGSEGV, 100)}
    assert first_failure(failures)[0] == 3
    assert failure_line(failures) == (
        "titanlite: rank 3 failed first (exit code 1); 2 other rank(s) stopped after it; see its output above",
        1,
    )


def test_a_user_error_is_printed_once_as_the_rank_that_met_it_wrote_it(tmp_path, monkeypatch):
    """Rank 1 alone met it (its data windows); rank 0 was stopped by the agent meanwhile."""
    line = "titanlite: error: shard-00000.bin: token id 70000 at 12 is outside the vocabulary (96)"
    failures = {0: failure(0, -signal.SIGTERM, 100), 1: failure(1, 2, 100, handed(tmp_path, monkeypatch, 1, line))}
    assert failure_line(failures, []) == (line, 2)


def test_a_user_error_wins_when_its_rank_was_stopped_after_a_peer_exited(tmp_path, monkeypatch):
    """Rank 1 met a data error and handed its line over, but was still in Python's teardown
    when rank 0, which met it as a closed connection, exited at once (exit 3): the agent then
    stopped rank 1 (SIGTERM). The user error is still the cause (tests/runs/test_errors.py)."""
    line = "titanlite: error: shard-00000.bin: token id 70000 at 12 is outside the vocabulary (96)"
    closed = "titanlite: rank 0: all_gather_single on group default_pg failed: a peer rank closed its connection"
    failures = {
        0: failure(0, COLLECTIVE_FAILURE_EXIT_CODE, 100, handed(tmp_path, monkeypatch, 0, closed)),
        1: failure(1, -signal.SIGTERM, 100, handed(tmp_path, monkeypatch, 1, line)),
    }
    assert failure_line(failures, []) == (line, 2)


def test_a_user_error_without_its_line_still_gets_one(tmp_path):
    failures = {0: failure(0, 2, 100), 1: failure(1, -signal.SIGTERM, 101)}
    assert failure_line(failures, []) == (
        "titanlite: rank 0 failed first (exit code 2); 1 other rank(s) stopped after it; see its output above",
        2,
    )


def test_a_stopped_rank_is_named_with_the_collective_that_waited_for_it(tmp_path, monkeypatch):
    """SIGSTOP of rank 1: rank 0's all-reduce timed out (exit 3), rank 1 was continued and
    stopped by the agent; the launcher found rank 1 stopped when it closed the workers."""
    said = handed(tmp_path, monkeypatch, 0, "titanlite: rank 0: an all-reduce timed out after 10 s")
    failures = {0: failure(0, COLLECTIVE_FAILURE_EXIT_CODE, 100, said), 1: failure(1, -signal.SIGTERM, 101)}
    assert failure_line(failures, [1]) == (
        "titanlite: rank 1 stopped responding (its process was stopped); rank 0: an all-reduce timed out after 10 s",
        3,
    )
    assert failure_line(failures, []) == ("titanlite: rank 0: an all-reduce timed out after 10 s", 3)


def test_the_collective_that_timed_out_is_named_before_one_that_met_the_kill(tmp_path, monkeypatch):
    """SIGSTOP of rank 2 on a loaded host: rank 3's all-gather timed out, the launcher killed
    rank 2, and rank 0, still waiting, met its connection closed: the line is rank 3's timeout
    (what the job waited for), not rank 0's closed connection (tests/runs/test_faults_runtime.py)."""
    closed = "titanlite: rank 0: a pipeline send/receive failed: a peer rank closed its connection (it died)"
    timeout = (
        "titanlite: rank 3: all_gather_single on group mesh_dp timed out after 10 s: a peer rank stopped answering"
    )
    failures = {
        0: failure(0, COLLECTIVE_FAILURE_EXIT_CODE, 100, handed(tmp_path, monkeypatch, 0, closed)),
        3: failure(3, COLLECTIVE_FAILURE_EXIT_CODE, 100, handed(tmp_path, monkeypatch, 3, timeout)),
    }
    assert (
        failure_line(failures, [2])[0]
        == f"titanlite: rank 2 stopped responding (its process was stopped); {timeout[11:]}"
    )


def test_outside_titanlites_launcher_a_worker_hands_nothing_over(tmp_path, monkeypatch):
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "error.json"))  # bare torchrun sets it too
    assert not hand_to_launcher("titanlite: error: x") and not (tmp_path / "error.json").exists()


def test_a_restart_names_the_rank_that_failed_first_and_counts_the_attempts():
    failures = {0: failure(0, COLLECTIVE_FAILURE_EXIT_CODE, 100), 5: failure(1, -signal.SIGKILL, 100)}
    assert restart_line(failures, 1, 3) == (
        "titanlite: rank 5 was killed by signal SIGKILL; restarting the job (1 of 3 "
        "restarts): it resumes from its newest complete checkpoint"
    )
    assert restart_line({2: failure(0, 7, 100)}, 2, 2).startswith(
        "titanlite: rank 2 failed (exit code 7); restarting the job (2 of 2"
    )
    assert restart_line({}, 1, 1).startswith("titanlite: the worker group became unhealthy; restarting")
