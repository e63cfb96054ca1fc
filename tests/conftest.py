"""Marks the multi-process and through-the-trainer test modules `slow`, so a quick subset
(`./run_tests.sh -m "not slow"`) runs in a few minutes while working. New tests mark
themselves with `@pytest.mark.slow`; these modules predate the marker and are slow as a whole
(each test starts several gloo processes or a full training run)."""

import pytest

SLOW_MODULES = {
    "test_parallel_equivalence",
    "test_mixed_precision",
    "test_checkpoint_dist",
    "test_checkpoint_train",
    "test_trainer_cli",
}
SLOW_TESTS = {"test_trainer_tp_layouts_match_one_process", "test_trainer_runs_gpt2"}  # test_gpt2's trainer runs


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
