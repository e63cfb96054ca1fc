"""Tests are marked by where they live: everything under tests/runs/ starts processes or
trains through the trainer and is `slow`, so a quick subset (`./run_tests.sh -m "not slow"`,
tests/unit/ alone) runs in a minute or two while working. Helpers sit in tests/helpers/.

The longest files run first. run_tests.sh gives each xdist worker whole files (`--dist
loadfile`) in the collection's order (`--no-loadscope-reorder`; xdist's own order, by the
number of tests in a file, started the few-test, many-process files last, and the last file
to start set the end of the run); with the long files first, the short ones fill in at the
end and the workers finish together."""

import os
from pathlib import Path

import pytest

RUNS = Path(__file__).parent / "runs"
# The seconds a file took in a whole run on a 2-core host (setup + call + teardown of its tests,
# `./run_tests.sh --durations=0`, 2026-11-29); only the order matters. A file not
# listed (a few seconds or less) keeps its place after these.
FILE_SECONDS = {
    "runs/test_pipeline_context_resume.py": 523,
    "runs/test_parallel_equivalence_4ranks.py": 508,
    "runs/test_faults_runtime.py": 412,
    "runs/test_parallel_equivalence.py": 401,
    "runs/test_plan.py": 326,
    "runs/test_parallel_equivalence_8_16ranks.py": 320,
    "runs/test_fault_tolerance.py": 308,
    "runs/test_checkpoint_train.py": 258,
    "runs/test_bad_input.py": 134,
    "runs/test_torchtitan_configs.py": 132,
    "runs/test_hf_sharded.py": 75,
    "runs/test_trainer_cli.py": 71,
    "runs/test_examples.py": 64,
    "runs/test_data_train.py": 54,
    "runs/test_mixed_precision.py": 50,
    "runs/test_validation.py": 46,
    "runs/test_gpu_check.py": 39,
    "runs/test_generate.py": 38,
    "runs/test_multinode.py": 37,
    "runs/test_checkpoint_dist.py": 34,
    "runs/test_init.py": 32,
    "runs/test_launch.py": 31,
    "runs/test_compat_ranks.py": 28,
    "runs/test_expert_resume_line.py": 25,
    "runs/test_participants.py": 17,
    "runs/test_sessions.py": 17,
    "runs/test_metrics.py": 15,
    "runs/test_plot_run.py": 14,
    "runs/test_profiling.py": 12,
    "runs/test_errors.py": 12,
}


_importorskip = pytest.importorskip


def importorskip_or_fail(modname: str, *args, **kwargs):
    """`pytest.importorskip` under ./run_tests.sh (TITANLITE_TESTS=1), where every package of the
    test extra is installed (scripts/ensure_env.sh checks them): a missing one fails the test in
    one line instead of skipping it unnoticed."""
    try:
        return _importorskip(modname, *args, **kwargs)
    except pytest.skip.Exception:
        pass  # failed below, outside the handler: one line, not the skip chained to it
    pytest.fail(f"test dependency {modname} is missing: pip install -e '.[test]'", pytrace=False)


if os.environ.get("TITANLITE_TESTS"):
    pytest.importorskip = importorskip_or_fail


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if RUNS in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.slow)
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: -FILE_SECONDS.get(Path(str(item.path)).as_posix().rpartition("/tests/")[2], 0))


@pytest.fixture
def logger_left_as_found():
    """A command's `main` or a trainer run in this process sets the titanlite logger up as a
    command does (`init_logger`: a handler on this test's captured stdout, no propagation); a
    later test in the same process finds it as it was, not writing to a closed capture."""
    from titanlite.logging import logger

    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate
