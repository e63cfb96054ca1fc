"""Helpers that start real multi-process gloo runs with a hard timeout."""

from __future__ import annotations

import functools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import warm_start
from titanlite.launch import set_cpu_worker_defaults

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trainer_worker.py")


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def with_overrides(*lists: list[str] | tuple[str, ...]) -> list[str]:
    """`--key value` pairs of several lists, a later list's value replacing an earlier one's
    (the command line itself refuses a key given twice)."""
    merged: dict[str, str] = {}
    for words in lists:
        merged.update(zip(words[::2], words[1::2]))
    return [word for pair in merged.items() for word in pair]


def run_ranks(
    nproc: int,
    entry: list[str],
    args: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """`nproc` processes of `python ENTRY ARGS` in the environment torchrun gives its workers
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT: the env:// rendezvous, a real TCPStore
    and gloo), started here rather than by torchrun's agent, which costs every run ~3 s of
    start-up and shutdown on two cores, and forked from a warm interpreter (warm_start.py;
    `fresh`: new interpreters). The launcher itself is tested through
    `python -m titanlite.launch` (test_launch, test_trainer_cli, test_faults_runtime,
    test_multinode, test_bad_input, test_checkpoint_train's kill test).

    Each rank's output goes to its own file, read back in rank order (stdout, then stderr, as
    one string each). When a rank fails, the others get `FAILED_RANK_GRACE_S` to end on their
    own and are then killed; the result's return code is the first failure's. A run past
    `timeout` x `timeout_scale()` is killed and raises `subprocess.TimeoutExpired` holding
    the ranks' output so far, so a hang fails the test and says where it was."""
    timeout *= timeout_scale()
    env = {**run_env(), **(env or {})}
    set_cpu_worker_defaults(str(nproc), env)  # what titanlite.launch gives CPU workers
    if nproc > 1:
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc)
        )
    command = [sys.executable, *entry, *args]
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        outputs = [(Path(folder) / f"{rank}.out", Path(folder) / f"{rank}.err") for rank in range(nproc)]
        processes = []
        try:
            for rank, (out, err) in enumerate(outputs):
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if nproc > 1 else env
                processes.append(warm_start.start([*entry, *args], rank_env, str(REPO), str(out), str(err), fresh))
            returncode = _wait_for_ranks(processes, timeout, command)
        except subprocess.TimeoutExpired as expired:
            _stop(processes)
            raise subprocess.TimeoutExpired(command, expired.timeout, *_read(outputs)) from None
        finally:
            _stop(processes)
        stdout, stderr = _read(outputs)
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def _read(outputs: list[tuple[Path, Path]]) -> tuple[str, str]:
    """Every rank's stdout, then every rank's stderr, each in rank order."""
    return tuple("".join(pair[i].read_text(errors="replace") for pair in outputs) for i in (0, 1))


TIMEOUT_SCALE_VAR = "TITANLITE_TEST_TIMEOUT_SCALE"
MAX_TIMEOUT_SCALE = 8.0


@functools.cache
def timeout_scale() -> float:
    """How much longer than their stated timeouts multi-process runs may take on this host:
    the hang guards are sized for a 2-core host running the suite alone, and a host loaded by
    other work (load 10-30 on 2 cores was seen) runs every process slower. The one-minute load
    average per core available to us when first asked (once per test process), at least 1 and
    at most 8; `TITANLITE_TEST_TIMEOUT_SCALE` sets it instead."""
    if os.environ.get(TIMEOUT_SCALE_VAR):
        return float(os.environ[TIMEOUT_SCALE_VAR])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_TIMEOUT_SCALE, max(1.0, os.getloadavg()[0] / cores))


FAILED_RANK_GRACE_S = 10.0


def _wait_for_ranks(processes: list[subprocess.Popen], timeout: float, command: list[str]) -> int:
    deadline, failed_at, first_failure = time.monotonic() + timeout, None, 0
    while any(p.poll() is None for p in processes):
        now = time.monotonic()
        if now > deadline:
            raise subprocess.TimeoutExpired(command, timeout)
        if not first_failure:
            first_failure = next((p.returncode for p in processes if p.returncode not in (None, 0)), 0)
            failed_at = now if first_failure else None
        elif now - failed_at > FAILED_RANK_GRACE_S:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.05)
    return first_failure or next((p.returncode for p in processes if p.returncode != 0), 0)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous endpoint that a rank binds later.

    Drawn at random from below the kernel's ephemeral range, not by binding port 0: a port
    the kernel hands out is also the pool of the local ends of outgoing connections, and in
    the time between this call and rank 0's TCPStore binding it, any connection on the host
    (the other xdist worker's ranks) may take it; rank 0 then fails and the other ranks get
    "Connection reset by peer" (seen once in a full run)."""
    ephemeral_low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0]) if EPHEMERAL_RANGE_FILE.exists() else 32768
    lowest = max(1024, ephemeral_low - 20000)
    if ephemeral_low - lowest < 1000:  # an ephemeral range reaching down to the reserved ports
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    draw = random.SystemRandom()  # independent of any seed a test sets
    for _ in range(200):
        port = draw.randrange(lowest, ephemeral_low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 below the ephemeral range ({ephemeral_low})")


MAINS_DRIVER = """
import importlib, json, os, sys, traceback
main = importlib.import_module(sys.argv[1]).main
for index, run in enumerate(json.loads(sys.argv[2])):
    argv, env = (run["argv"], run["env"]) if isinstance(run, dict) else (run, {})
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(key, None)
    os.environ.update(env)
    for stream in (sys.stdout, sys.stderr):
        print(f"@@case {index}", file=stream, flush=True)
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        print(f"@@rc {index} {code}", file=stream, flush=True)
"""


def run_mains(
    module: str, argvs: list[list[str]], timeout: float, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    """Each argv through `module.main(argv)` (what `python -m module ARGV` calls), one after
    the other in one interpreter (a warm one, warm_start.py), as a world of one. One
    CompletedProcess per argv, with that run's exit code (an argparse exit's, or 1 and the
    traceback for an exception) and its share of stdout and stderr; a run that did not finish
    (in `timeout` x `timeout_scale()`) fails the test with the driver's output."""
    command = mains_command(module, argvs)[1:]
    result = warm_start.run(command, env or run_env(), timeout * timeout_scale())
    return split_mains(module, argvs, result)


def mains_command(module: str, argvs: list[list[str]] | list[dict]) -> list[str]:
    """The one interpreter `run_mains` starts, for a caller that runs it its own way; a run
    given as {"argv", "env"} has those variables set (RANK, WORLD_SIZE: as torchrun's rank 0)."""
    return [sys.executable, "-c", MAINS_DRIVER, module, json.dumps(argvs)]


def split_mains(module: str, argvs: list[list[str]], result) -> list[subprocess.CompletedProcess]:
    """`mains_command`'s output (any result with stdout, stderr and returncode) as one
    CompletedProcess per argv; a run that did not finish fails the test."""
    outs, errs = _cases(result.stdout), _cases(result.stderr)
    missing = [index for index in range(len(argvs)) if index not in errs or index not in outs]
    assert not missing, f"{module}: runs {missing} did not finish (exit {result.returncode}):\n{result.stderr[-4000:]}"
    return [subprocess.CompletedProcess(argv, errs[i][0], outs[i][1], errs[i][1]) for i, argv in enumerate(argvs)]


def _cases(stream: str) -> dict[int, tuple[int, str]]:
    """The driver's output split by its markers: index -> (exit code, text in between)."""
    found = {}
    for block in stream.split("@@case ")[1:]:
        index, _, rest = block.partition("\n")
        body, marker, tail = rest.partition(f"@@rc {index} ")
        if marker:
            found[int(index)] = (int(tail.split()[0]), body)
    return found


def run_trainer_worker(nproc: int, args: list[str], out: Path, timeout: float = 240) -> dict:
    """Train with `args` (`--key value` pairs, a later one replacing an earlier) on `nproc`
    processes; returns the worker's JSON (history, per-rank bytes)."""
    result = run_ranks(nproc, [str(WORKER), str(out)], with_overrides(args), timeout)
    if result.returncode != 0:
        raise AssertionError(f"trainer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return json.loads(out.read_text())


# The fp32 recipe under which every parallel layout must reproduce one process's curve. Three
# logged steps hold every kind of work a step does: step 1's loss and grad norm compare forward
# and backward from the same weights, step 2's the first optimizer update (AdamW's fresh state,
# the expert biases' first move), step 3's the second, which reads the state the first left
# (moments, momentum) at the full lr; a fourth and fifth repeat the third. (The last step's own
# update, at lr 0 where the schedule decays, is in no logged figure.)
EQUIVALENCE_STEPS = 3
EQUIVALENCE_ARGS = [
    "--config",
    "debug_model",
    "--training.steps",
    str(EQUIVALENCE_STEPS),
    "--training.seq_len",
    "64",
    "--training.mixed_precision_param",
    "float32",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.peak_flops",
    "1e11",  # MFU's peak given: no start-up matmul measurement (0.5 s a rank)
]


def assert_same_curve(history: list[dict], reference: list[dict], label: str, rel: float = 1e-5) -> None:
    """Every step of the reference's run (EQUIVALENCE_ARGS: steps 1-3) logged, with its loss and grad norm."""
    assert reference and [h["step"] for h in history] == [h["step"] for h in reference] == list(
        range(1, len(reference) + 1)
    ), f"{label}: steps {[h['step'] for h in history]}"
    for ours, ref in zip(history, reference):
        for key in ("loss", "grad_norm"):
            assert ours[key] == pytest.approx(ref[key], rel=rel), (
                f"{label} step {ref['step']} {key}: {ours[key]} vs {ref[key]}"
            )


def read_tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the (single) run under `folder`, as (step, value) lists."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(p.parent for p in folder.rglob("events.out.tfevents.*"))
    assert runs, f"no TensorBoard event files under {folder}"
    accumulator = EventAccumulator(str(runs[-1]))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
