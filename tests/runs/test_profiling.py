"""Profiler traces of chosen steps (one Chrome trace per rank, with the step's forward,
backward and collectives), CUDA memory snapshots, and nothing at all when both are off."""

from __future__ import annotations

import json

import pytest

from tests.helpers.commands import TEST_TIMEOUT, launch
from tests.unit.test_profiling import CUDA_ONLY_LINE


def span(event: dict) -> tuple[float, float]:
    return event["ts"], event["ts"] + event.get("dur", 0)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_process_run_traces_each_rank_with_forward_backward_and_collectives(tmp_path):
    run = launch(
        2,
        [
            "--config",
            "debug_model",
            "--training.steps",
            "3",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--metrics.enable_tensorboard",
            "false",
            "--profiling.enable_profiling",
            "--profiling.profile_freq",
            "2",
            "--profiling.enable_memory_snapshot",
            "--job.dump_folder",
            str(tmp_path),
        ],
    )
    assert run.returncode == 0, run.describe()
    assert run.output.count(CUDA_ONLY_LINE) == 1, run.describe()
    traces = tmp_path / "profile_traces"
    assert [p.name for p in traces.iterdir()] == ["iteration_2"]
    assert sorted(p.name for p in (traces / "iteration_2").iterdir()) == [
        "rank0_ops.txt",
        "rank0_trace.json",
        "rank1_ops.txt",
        "rank1_trace.json",
    ]
    assert "aten::mm" in (traces / "iteration_2" / "rank0_ops.txt").read_text()  # the by-op table
    for rank in (0, 1):
        events = json.loads((traces / "iteration_2" / f"rank{rank}_trace.json").read_text())["traceEvents"]
        steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
        assert len(steps) == 1, f"rank {rank}: expected the one traced step, got {[e['name'] for e in steps]}"
        start, end = span(steps[0])
        inside = [e["name"] for e in events if "ts" in e and start <= e["ts"] <= end]
        kinds = {
            "forward": [n for n in inside if n == "aten::embedding"],
            "backward": [n for n in inside if n.endswith("Backward0")],
            "collective": [n for n in inside if n.startswith(("gloo:", "c10d::", "_c10d_functional::"))],
        }
        for kind, names in kinds.items():
            assert names, f"rank {rank}: no {kind} events in the traced step"
