"""Two nodes on one machine: two `run_train.sh` launchers (NNODES=2, 2 processes each)
meet through c10d rendezvous on 127.0.0.1 and train FSDP 2 x TP 2 across the 4 processes,
with the losses of one launcher running the same layout.

c10d numbers the nodes itself (the launcher that hosts the store first is not necessarily
node 0), so no node rank is passed: the test reads the ranks the agents were given.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.commands import ANY_STEP_LINE, MARKER_VAR, kill_marked
from tests.helpers.distributed import REPO, free_port, run_env
from titanlite.observe.run_dir import read_metrics

RUN_TIMEOUT = 300  # seconds per launch; 4 processes share 2 cores with other suites
STEPS = 3
ARGS = [
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--lr_scheduler.warmup_steps",
    "1",
    "--optimizer.lr",
    "3e-3",
    "--parallelism.tensor_parallel_degree",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.peak_flops",
    "1e11",  # no start-up matmul measurement
]


def launch_nodes(node_envs: list[dict[str, str]], dump_folder: Path, logs: Path) -> list[str]:
    """One `run_train.sh` per entry of `node_envs`, all at once; returns each one's output.
    Output goes to files (a full pipe would stall a launcher); a hang kills every process
    started here (found by a marker in their environment) and fails the test."""
    marker = uuid.uuid4().hex
    logs.mkdir(parents=True, exist_ok=True)
    outputs = [logs / f"node{i}.log" for i in range(len(node_envs))]
    processes = []
    for node_env, output in zip(node_envs, outputs):
        env = {**run_env(), "LOGLEVEL": "INFO", MARKER_VAR: marker, **node_env}
        with open(output, "w") as sink:
            processes.append(
                subprocess.Popen(
                    [str(REPO / "run_train.sh"), *ARGS, "--job.dump_folder", str(dump_folder)],
                    cwd=REPO,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in processes]
    except subprocess.TimeoutExpired:
        killed = kill_marked(marker)
        texts = "\n".join(f"--- {o.name} ---\n{o.read_text()[-4000:]}" for o in outputs)
        pytest.fail(f"launchers did not finish in {RUN_TIMEOUT} s (killed {killed}):\n{texts}")
    texts = [o.read_text() for o in outputs]
    for code, text in zip(codes, texts):
        assert code == 0, f"a launcher exited with {code}:\n" + "\n".join(t[-4000:] for t in texts)
    return texts


def only_run(dump_folder: Path) -> Path:
    (run_dir,) = (dump_folder / "runs").iterdir()
    return run_dir


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_two_launchers_as_two_nodes_train_like_one(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    two_nodes = launch_nodes(
        [{"NNODES": "2", "NPROC": "2", "RDZV_ENDPOINT": endpoint}] * 2, tmp_path / "two_nodes", tmp_path / "logs_two"
    )
    agents = [re.search(r"group_rank=(\d+)", text) for text in two_nodes]
    assert all(agents), "no rendezvous result in a launcher's output:\n" + "\n".join(t[-3000:] for t in two_nodes)
    assert sorted(int(a[1]) for a in agents) == [0, 1]
    assert all("global_world_sizes=[4, 4]" in text for text in two_nodes)
    assert [bool(ANY_STEP_LINE.search(text)) for text in two_nodes].count(True) == 1  # rank 0 logs, on one node

    launch_nodes([{"NNODES": "1", "NPROC": "4"}], tmp_path / "one_node", tmp_path / "logs_one")

    ours, reference = read_metrics(only_run(tmp_path / "two_nodes")), read_metrics(only_run(tmp_path / "one_node"))
    assert [r["step"] for r in ours] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    for a, b in zip(ours, reference):
        for key in ("loss", "grad_norm", "tokens_seen"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (
                f"step {a['step']} {key}: two nodes {a[key]}, one node {b[key]}"
            )


def test_several_nodes_without_a_rendezvous_endpoint_is_one_line(tmp_path):
    env = {k: v for k, v in run_env().items() if k != "RDZV_ENDPOINT"}
    result = subprocess.run(
        [str(REPO / "run_train.sh")],
        cwd=REPO,
        env={**env, "NNODES": "2", "NPROC": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "titanlite: error: NNODES=2 needs RDZV_ENDPOINT=host:port (the first node's address, the same on every node)"
    ]
    assert not result.stdout
