"""Every parallel layout of 8 processes, and every dimension at once on 16, trains exactly like
one process (tests/runs/equivalence.py says what and how).
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import EQUIVALENCE_ARGS, assert_same_curve, timeout_scale
from tests.helpers.sessions import Case, SessionCases, run_session
from tests.runs.equivalence import (
    ALL_DIMENSIONS,
    ALL_DIMENSIONS_TIMEOUT_S,
    ALL_DIMENSIONS_WORLD,
    EP,
    LAYOUTS,
    TIMEOUT_S,
    layouts_of,
    run_sessions,
)
from tests.runs.equivalence_checks import (
    assert_expert_shares,
    check_layout,
)

WORLD = 8


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> SessionCases:
    return run_sessions(tmp_path_factory, {WORLD: []})


@pytest.mark.timeout(sum(TIMEOUT_S.values()) * timeout_scale())
@pytest.mark.parametrize("layout", layouts_of(WORLD, LAYOUTS))
def test_layout_matches_single_process(layout, sessions):
    check_layout(layout, sessions)


@pytest.fixture(scope="module")
def all_dimensions(tmp_path_factory) -> SessionCases:
    cases = [Case(name, [*EQUIVALENCE_ARGS, *overrides]) for name, (overrides, _) in ALL_DIMENSIONS.items()]
    results = SessionCases()
    results.add(run_session(ALL_DIMENSIONS_WORLD, cases, tmp_path_factory.mktemp("world16"), ALL_DIMENSIONS_TIMEOUT_S))
    return results


@pytest.mark.slow
@pytest.mark.timeout((ALL_DIMENSIONS_TIMEOUT_S + sum(TIMEOUT_S.values())) * timeout_scale())
@pytest.mark.parametrize("layout", ALL_DIMENSIONS)
def test_every_dimension_at_once_matches_single_process(layout, all_dimensions, sessions):
    overrides, reference_name = ALL_DIMENSIONS[layout]
    reference = sessions[f"reference_{reference_name}"]
    assert_same_curve(all_dimensions[layout]["history"], reference["history"], layout)
    if "moe_load_mean" in reference["history"][0]:
        assert [h["moe_load_max"] for h in all_dimensions[layout]["history"]] == pytest.approx(
            [h["moe_load_max"] for h in reference["history"]], rel=1e-6
        )
    if EP[0] in overrides:
        assert_expert_shares(all_dimensions[layout]["ranks"], reference["ranks"][0], overrides, ALL_DIMENSIONS_WORLD)
