"""Preparation into token shards as a command: an interrupted run (kill -9 of a worker
mid-shard) resumes to identical files, the first-use cache shared by two processes, one line
for each command-line error, --help. (prepare on one process: tests/unit/test_prepare.py.)"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.distributed import REPO, run_env
from tests.helpers.token_data import SHIPPED, folder_bytes, prepared, tok, write_corpus  # noqa: F401 (fixtures)
from titanlite.data.cache import ensure_prepared


def prepare_cli(
    source: Path | str, output: Path, *args: str, env: dict | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.data.prepare", str(source), str(output), "--tokenizer", str(SHIPPED), *args]
    return subprocess.run(
        cmd, cwd=REPO, env={**run_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(300)
def test_kill_9_of_a_worker_mid_shard_resumes_to_identical_files(tmp_path, prepared):
    folder, _ = prepared
    text = folder.parent / "text"
    output = tmp_path / "resumed"
    args = ("--workers", "2", "--shard-mb", "0.004")
    process = subprocess.Popen(
        [sys.executable, "-m", "titanlite.data.prepare", str(text), str(output), "--tokenizer", str(SHIPPED), *args],
        cwd=REPO,
        env={**run_env(), "TITANLITE_TEST_PREPARE_PAUSE_S": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = None
    deadline = time.monotonic() + 120
    try:
        while killed is None and time.monotonic() < deadline and process.poll() is None:
            partial = [p for p in output.glob("shard-*.bin.tmp-*")] if output.is_dir() else []
            if partial and any(output.glob("shard-*.idx")):  # some shards done, one half-written
                killed = int(partial[0].name.rsplit("-", 1)[1])
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert killed is not None, "no worker was caught mid-shard"
    assert process.returncode == 1 and not (output / "manifest.json").exists()
    assert stderr.strip().splitlines() == [
        f"titanlite: error: a tokenizer worker died before finishing its shard; "
        f"run the same command again to resume {output}"
    ]
    done_before = {p.name for p in output.glob("shard-*.idx")}
    result = prepare_cli(text, output, *args)
    assert result.returncode == 0, result.stderr
    assert folder_bytes(output) == folder_bytes(folder)  # identical to the uninterrupted run
    assert done_before and not list(output.glob("*.tmp-*"))


@pytest.mark.timeout(300)
def test_first_use_cache_prepares_once_and_never_uses_half_written(tmp_path, prepared, tok):
    text = tmp_path / "text"
    write_corpus(text, n=60, seed=3)
    cache = tmp_path / "cache"
    # Two processes race for the entry: one prepares, the other waits and reads the same folder.
    script = (
        "import sys; from titanlite.logging import init_logger; init_logger(0); from titanlite.data.cache import "
        "ensure_prepared; "
        "from titanlite.data.tokenizers import Tokenizer; "
        "print('@@', ensure_prepared('files', sys.argv[1], Tokenizer(sys.argv[2]), sys.argv[3]))"
    )
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(text), str(SHIPPED), str(cache)],
            cwd=REPO,
            env=run_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [r.communicate(timeout=180)[0] for r in racers]
    folders = {line.split("@@ ")[1] for out in outputs for line in out.splitlines() if line.startswith("@@ ")}
    assert len(folders) == 1, outputs
    assert sum(out.count("data: preparing") for out in outputs) == 1, outputs
    folder = Path(folders.pop())
    complete = folder_bytes(folder)
    # A half-written entry (manifest gone, a shard cut short) is completed, never used as it is.
    (folder / "manifest.json").unlink()
    last = sorted(folder.glob("shard-*.bin"))[-1]
    last.write_bytes(last.read_bytes()[:10])
    assert ensure_prepared("files", str(text), tok, str(cache)) == folder
    assert folder_bytes(folder) == complete
    # Edited text is another entry.
    (text / "docs.jsonl").write_text(json.dumps({"text": "something else entirely"}) + "\n")
    assert ensure_prepared("files", str(text), tok, str(cache)) != folder


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "random.txt"
    bad.write_bytes(random.Random(1).randbytes(8000))
    cases = {
        "missing source": ([str(tmp_path / "nope"), str(tmp_path / "o1")], "SOURCE: not found: "),
        "random bytes": ([str(bad), str(tmp_path / "o2")], "SOURCE: " + str(bad) + " is not"),
        "no workers": (["builtin", str(tmp_path / "o3"), "--workers", "0"], "--workers must be >= 1"),
    }
    for name, (args, start) in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "titanlite.data.prepare", *args, "--tokenizer", str(SHIPPED)],
            cwd=REPO,
            env=run_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("titanlite: error: " + start), (
            name,
            result.stderr,
        )


def test_help_documents_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "titanlite.data.prepare", "--help"],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        result.returncode == 0
        and "SOURCE" in result.stdout
        and "--workers" in result.stdout
        and "docs/data.md" in result.stdout
    )
