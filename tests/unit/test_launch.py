"""The launcher and the scripts around it: which rank it blames, its one-line endings,
workers that die with it, run_train.sh's checks and --help, and the Slurm script's
argument forwarding (with stand-in `srun`/`scontrol` that record what they are given)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tests.helpers.distributed import REPO, run_env
from tests.helpers.commands import assert_one_line_user_error, marked_processes, run_command
from titanlite.errors import COLLECTIVE_FAILURE_EXIT_CODE
from titanlite.launch import failure_line, first_failure, set_cpu_thread_defaults
from titanlite.parallel.distributed import usable_cores
from titanlite.runtime.cpu_binding import core_blocks


def test_cpu_workers_get_their_share_of_cores_and_a_short_openmp_spin(monkeypatch):
    """What the launcher puts in CPU workers' environment, and that a caller's value wins."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    set_cpu_thread_defaults("2")
    assert os.environ["OMP_NUM_THREADS"] == str(max(1, usable_cores() // 2))
    assert (os.environ["OMP_WAIT_POLICY"], os.environ["GOMP_SPINCOUNT"]) == ("PASSIVE", "1000")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    set_cpu_thread_defaults("2")
    assert (os.environ["OMP_NUM_THREADS"], os.environ["GOMP_SPINCOUNT"]) == ("7", "0")


def test_cpu_bind_splits_the_cores_into_one_block_per_rank():
    assert core_blocks([0, 1], 2) == [[0], [1]]
    assert core_blocks([4, 5, 6, 7], 2) == [[4, 5], [6, 7]]
    assert core_blocks([0, 1, 2], 2) == [[0], [1]]
    assert core_blocks([0, 1], 4) == [[0], [1], [0], [1]]  # more ranks than cores: shared round-robin


@pytest.mark.timeout(120)
def test_cpu_bind_puts_each_worker_on_its_own_cores(tmp_path):
    """Two workers under `--cpu-bind` bind themselves (as the trainer's command line does)
    and report their affinity; without the flag nothing is bound. Both workers share the one
    stdout pipe, so each writes its line in a single `os.write` (atomic below PIPE_BUF): `print`
    writes its pieces one by one when PYTHONUNBUFFERED is set, and the lines interleave."""
    worker = tmp_path / "affinity.py"
    worker.write_text("import os\nfrom titanlite.runtime.cpu_binding import bind_from_env\nbind_from_env()\n"
                      "line = f\"rank {os.environ['LOCAL_RANK']} cores {sorted(os.sched_getaffinity(0))}\\n\"\n"
                      "os.write(1, line.encode())\n")
    cores = sorted(os.sched_getaffinity(0))
    expected = {str(rank): block for rank, block in enumerate(core_blocks(cores, 2))}
    for flags, want in ((["--cpu-bind"], expected), ([], {"0": cores, "1": cores})):
        command = [sys.executable, "-m", "titanlite.launch", "--standalone", "--nproc-per-node=2", *flags, str(worker)]
        result = subprocess.run(command, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=100)
        assert result.returncode == 0, result.stderr
        seen = {line.split()[1]: json.loads(line.split(" cores ")[1]) for line in result.stdout.splitlines() if line.startswith("rank ")}
        assert seen == want, (flags, result.stdout)


def failure(local_rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    made = ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file="")
    made.timestamp = timestamp
    return made


def test_the_killed_rank_is_named_not_the_ranks_that_failed_because_of_it():
    """rank 1 killed; rank 0's collective failed in the same second and was seen first
    (torchrun's timestamps are whole seconds); rank 2 was stopped by the agent."""
    failures = {0: failure(0, COLLECTIVE_FAILURE_EXIT_CODE, 100), 1: failure(1, -signal.SIGKILL, 100), 2: failure(2, -signal.SIGTERM, 100)}
    assert first_failure(failures)[0] == 1
    line, code = failure_line(failures)
    assert line == "titanlite: rank 1 failed first (killed by signal SIGKILL); 2 other rank(s) stopped after it"
    assert code == 1


def test_the_earliest_cause_wins_then_the_order_seen():
    failures = {0: failure(0, 1, 101), 3: failure(3, 1, 100), 1: failure(1, -signal.SIGSEGV, 100)}
    assert first_failure(failures)[0] == 3
    assert failure_line(failures) == ("titanlite: rank 3 failed first (exit code 1); 2 other rank(s) stopped after it; see its output above", 1)


def test_a_user_error_first_is_left_to_the_rank_that_printed_it():
    failures = {0: failure(0, 2, 100), 1: failure(1, 2, 103)}
    assert failure_line(failures) == (None, 2)


@pytest.mark.parametrize("variable, value", [("NPROC", "0"), ("NPROC", "abc"), ("NNODES", "0"), ("MAX_RESTARTS", "-1"), ("LOG_RANK", "5")])
def test_run_train_script_checks_its_variables(variable, value):
    run = run_command([str(REPO / "run_train.sh"), "--training.steps", "1"], {**run_env(), "NPROC": "2", variable: value}, timeout=120)
    assert_one_line_user_error(run, [variable, repr(value)])


def test_launcher_checks_nproc_per_node():
    run = run_command([sys.executable, "-m", "titanlite.launch", "--standalone", "--nproc-per-node", "0",
                       "-m", "titanlite.train"], run_env(), timeout=120)
    assert_one_line_user_error(run, ["--nproc-per-node", "'0'"])


def test_run_train_help_prints_the_options_without_torchrun():
    run = run_command([str(REPO / "run_train.sh"), "--training.steps", "3", "--help"], run_env(), timeout=120)
    assert run.returncode == 0, run.describe()
    assert run.stdout.startswith("usage: python -m titanlite.train"), run.describe()
    assert "--training.steps" in run.stdout and "--comm.train_timeout_seconds" in run.stdout, run.describe()
    assert "[rank" not in run.output and "torch.distributed" not in run.output, run.describe()


def _stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_slurm_script_forwards_arguments_with_their_quoting(tmp_path):
    """`sbatch multinode_trainer.slurm ...` as Slurm would run it, with `srun` and
    `scontrol` replaced by recorders: the training command gets every argument intact."""
    script = REPO / "multinode_trainer.slurm"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    record = tmp_path / "calls.jsonl"
    recorder = (
        "import json, os, sys\n"
        f"with open({str(record)!r}, 'a') as f:\n"
        "    env = {k: os.environ.get(k) for k in ('NNODES', 'RDZV_ENDPOINT', 'MAX_RESTARTS')}\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'env': env}) + '\\n')\n"
    )
    _stand_in(tmp_path, "srun", recorder + "if 'hostname' in sys.argv: print('10.1.2.3 fe80::1')\n")
    _stand_in(tmp_path, "scontrol", "print('node-a'); print('node-b')\n")
    env = {**run_env(), "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(REPO), "MAX_RESTARTS": "2"}
    given = ["--training.steps", "5", "--job.description", "two words, 'quoted' and $HOME", "--x=*"]
    result = subprocess.run(["bash", str(script), *given], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls[0]["argv"] == ["--nodes=1", "--ntasks=1", "-w", "node-a", "hostname", "--ip-address"]
    assert calls[-1]["argv"] == ["--kill-on-bad-exit=1", f"--chdir={REPO}", "./run_train.sh", "--config", "llama_8b.toml", *given]
    assert calls[-1]["env"] == {"NNODES": "2", "RDZV_ENDPOINT": "10.1.2.3:29500", "MAX_RESTARTS": "2"}
