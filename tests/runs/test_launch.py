"""The launcher and the scripts around it, run as commands: workers bound by --cpu-bind,
workers that die with it, Ctrl-C's one line, run_train.sh's checks and --help, and the Slurm
script's argument forwarding (with stand-in `srun`/`scontrol` that record what they are given).
Which rank it blames, on one process: tests/unit/test_launch.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.commands import assert_one_line_user_error, marked_processes, run_command
from tests.helpers.distributed import REPO, run_env
from tests.helpers.live_run import LiveRun, running
from titanlite.runtime.cpu_binding import core_blocks

SHORT = [
    "--config",
    "debug_model",
    "--training.steps",
    "200",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
]


@pytest.mark.timeout(120)
def test_cpu_bind_puts_each_worker_on_its_own_cores(tmp_path):
    """Two workers under `--cpu-bind` bind themselves (as the trainer's command line does)
    and report their affinity; without the flag nothing is bound. Both workers share the one
    stdout pipe, so each writes its line in a single `os.write` (atomic below PIPE_BUF): `print`
    writes its pieces one by one when PYTHONUNBUFFERED is set, and the lines interleave."""
    worker = tmp_path / "affinity.py"
    worker.write_text(
        "import os\nfrom titanlite.runtime.cpu_binding import bind_from_env\nbind_from_env()\n"
        "line = f\"rank {os.environ['LOCAL_RANK']} cores {sorted(os.sched_getaffinity(0))}\\n\"\n"
        "os.write(1, line.encode())\n"
    )
    cores = sorted(os.sched_getaffinity(0))
    expected = {str(rank): block for rank, block in enumerate(core_blocks(cores, 2))}
    for flags, want in ((["--cpu-bind"], expected), ([], {"0": cores, "1": cores})):
        command = [sys.executable, "-m", "titanlite.launch", "--standalone", "--nproc-per-node=2", *flags, str(worker)]
        result = subprocess.run(command, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=100)
        assert result.returncode == 0, result.stderr
        seen = {
            line.split()[1]: json.loads(line.split(" cores ")[1])
            for line in result.stdout.splitlines()
            if line.startswith("rank ")
        }
        assert seen == want, (flags, result.stdout)


@pytest.mark.timeout(400)
def test_workers_die_with_a_killed_launcher(tmp_path):
    """kill -9 of the launcher: no worker trains on unsupervised."""
    live = LiveRun(2, [*SHORT, "--job.dump_folder", str(tmp_path)])
    live.wait_for(r"step +1 +loss", 300)
    workers = [live.worker_pid(0), live.worker_pid(1)]
    live.signal_launcher(signal.SIGKILL)
    deadline = time.monotonic() + 15
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [pid for pid in workers if running(pid)]
    if orphans:
        live.abort(f"workers {orphans} outlived their launcher by 15 s")
    live.finish(30)
    assert not marked_processes(live.marker)


@pytest.mark.timeout(400)
def test_ctrl_c_ends_the_run_with_one_line(tmp_path):
    """SIGINT to the launcher (Ctrl-C): every process ends, one line, no traceback."""
    live = LiveRun(2, [*SHORT, "--job.dump_folder", str(tmp_path)])
    live.wait_for(r"step +1 +loss", 300)
    live.signal_launcher(signal.SIGINT)
    run = live.finish(60)
    assert run.returncode == 128 + signal.SIGINT, run.describe()
    lines = [line for line in run.stdout.splitlines() if line.startswith("titanlite:")]
    assert lines == [
        "titanlite: stopped by SIGINT; the workers were stopped without a checkpoint (SIGTERM or SIGUSR1 saves one "
        "first)"
    ], run.describe()
    assert "Traceback" not in run.stdout, run.describe()


@pytest.mark.parametrize(
    "variable, value", [("NPROC", "0"), ("NPROC", "abc"), ("NNODES", "0"), ("MAX_RESTARTS", "-1"), ("LOG_RANK", "5")]
)
def test_run_train_script_checks_its_variables(variable, value):
    run = run_command(
        [str(REPO / "run_train.sh"), "--training.steps", "1"], {**run_env(), "NPROC": "2", variable: value}, timeout=120
    )
    assert_one_line_user_error(run, [variable, repr(value)])


@pytest.mark.timeout(400)
def test_a_user_error_is_not_restarted(tmp_path):
    """MAX_RESTARTS 2 and a config value every rank refuses after the workers started (tp 3 on
    2 processes): the job ends at once with that one line and exit code 2, no restart."""
    run = run_command(
        [str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--parallelism.tensor_parallel_degree", "3"],
        {**run_env(), "NPROC": "2", "MAX_RESTARTS": "2"},
        timeout=300,
    )
    assert_one_line_user_error(run, ["world size 2", "tensor_parallel_degree 3"])
    assert "restarting" not in run.output, run.describe()


def test_launcher_checks_nproc_per_node():
    run = run_command(
        [sys.executable, "-m", "titanlite.launch", "--standalone", "--nproc-per-node", "0", "-m", "titanlite.train"],
        run_env(),
        timeout=120,
    )
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
    env = {
        **run_env(),
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_SUBMIT_DIR": str(REPO),
        "MAX_RESTARTS": "2",
    }
    given = ["--training.steps", "5", "--job.description", "two words, 'quoted' and $HOME", "--x=*"]
    result = subprocess.run(["bash", str(script), *given], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls[0]["argv"] == ["--nodes=1", "--ntasks=1", "-w", "node-a", "hostname", "--ip-address"]
    assert calls[-1]["argv"] == [
        "--kill-on-bad-exit=1",
        f"--chdir={REPO}",
        "./run_train.sh",
        "--config",
        "llama_8b.toml",
        *given,
    ]
    assert calls[-1]["env"] == {"NNODES": "2", "RDZV_ENDPOINT": "10.1.2.3:29500", "MAX_RESTARTS": "2"}

    # REPLICA_GROUPS=2: a lighthouse on the first node, each node its own fault-tolerant group.
    record.unlink()
    result = subprocess.run(
        ["bash", str(script), *given], env={**env, "REPLICA_GROUPS": "2"}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    (lighthouse,) = [c["argv"] for c in calls if "torchft_lighthouse" in c["argv"]]
    assert lighthouse[:5] == ["--overlap", "--nodes=1", "--ntasks=1", "-w", "node-a"]
    groups = sorted((c for c in calls if "./run_train.sh" in c["argv"]), key=lambda c: c["argv"][-1])
    for g, call in enumerate(groups):
        assert call["argv"][call["argv"].index("-w") + 1] == f"node-{'ab'[g]}"
        assert call["argv"][-8:] == [
            *given[-2:],
            "--fault_tolerance.enable",
            "true",
            "--fault_tolerance.group_size",
            "2",
            "--fault_tolerance.replica_id",
            str(g),
        ]
        assert call["env"] == {"NNODES": "1", "RDZV_ENDPOINT": "10.1.2.3:29500", "MAX_RESTARTS": "0"}
