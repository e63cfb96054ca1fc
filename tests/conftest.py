"""Marks the multi-process and through-the-trainer test modules `slow`, so a quick subset
(`./run_tests.sh -m "not slow"`) runs in a few minutes while working. New tests mark
themselves with `@pytest.mark.slow`; these modules predate the marker and are slow as a whole
(each test starts several gloo processes or a full training run).

Also orders the modules longest first (`LONGEST_FIRST`, from `--durations` of a whole run on
2 cores): run_tests.sh hands whole files to two xdist workers in collection order, so the
long ones start at once and the short ones fill in at the end instead of one long file
running alone last."""

import pytest

SLOW_MODULES = {
    "test_parallel_equivalence",
    "test_mixed_precision",
    "test_checkpoint_dist",
    "test_checkpoint_train",
    "test_trainer_cli",
}
LONGEST_FIRST = [
    "test_checkpoint_train",
    "test_faults_runtime",
    "test_plan",
    "test_tied_embeddings",
    "test_parallel_equivalence",
    "test_trainer_cli",
    "test_compile",
    "test_multinode",
    "test_validation",
    "test_mixed_precision",
    "test_data_train",
    "test_checkpoint_dist",
    "test_gpt2",
    "test_bad_input",
]
SLOW_TESTS = {"test_trainer_tp_layouts_match_one_process", "test_trainer_runs_gpt2"}  # test_gpt2's trainer runs


def _module(item: pytest.Item) -> str:
    return item.module.__name__.rpartition(".")[2] if item.module else ""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: file order kept otherwise
    for item in items:
        if _module(item) in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
