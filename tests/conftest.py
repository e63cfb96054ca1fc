"""Tests are marked by where they live: everything under tests/runs/ starts processes or
trains through the trainer and is `slow`, so a quick subset (`./run_tests.sh -m "not slow"`,
tests/unit/ alone) runs in a minute or two while working. Helpers sit in tests/helpers/.

The longest files run first. run_tests.sh gives each xdist worker whole files (`--dist
loadfile`) in the collection's order (`--no-loadscope-reorder`; xdist's own order, by the
number of tests in a file, started the few-test, many-process files last, and the last file
to start set the end of the run); with the long files first, the short ones fill in at the
end and both workers finish together."""

from pathlib import Path

import pytest

RUNS = Path(__file__).parent / "runs"
# About the seconds a file takes on a quiet 2-core host (setup + call + teardown of its tests,
# `./run_tests.sh --durations=0`); only the order matters, so estimates do. A file not
# listed (a few seconds or less) keeps its place after these.
FILE_SECONDS = {
    "runs/test_pipeline_context_resume.py": 250,
    "runs/test_parallel_equivalence_4ranks.py": 230,
    "runs/test_fault_tolerance.py": 220,
    "runs/test_parallel_equivalence_8_16ranks.py": 200,
    "runs/test_faults_runtime.py": 200,
    "runs/test_parallel_equivalence.py": 170,
    "runs/test_checkpoint_train.py": 150,
    "runs/test_plan.py": 120,
    "runs/test_hf_sharded.py": 120,
    "runs/test_generate.py": 100,
    "runs/test_bad_input.py": 80,
    "runs/test_torchtitan_configs.py": 76,
    "runs/test_trainer_cli.py": 70,
    "runs/test_launch.py": 70,
    "runs/test_mixed_precision.py": 60,
    "runs/test_compile.py": 60,
    "runs/test_examples.py": 60,
    "runs/test_multinode.py": 50,
    "runs/test_data_train.py": 50,
    "runs/test_validation.py": 40,
    "runs/test_compat_ranks.py": 40,
    "runs/test_checkpoint_dist.py": 40,
    "runs/test_prepare.py": 30,
    "runs/test_expert_resume_line.py": 25,
    "runs/test_errors.py": 25,
    "runs/test_metrics.py": 20,
    "runs/test_sessions.py": 20,
    "runs/test_precision.py": 15,
    "runs/test_profiling.py": 15,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if RUNS in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.slow)
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: -FILE_SECONDS.get(Path(str(item.path)).as_posix().rpartition("/tests/")[2], 0))
