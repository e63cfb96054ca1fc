"""A training session past its timeout (tests/helpers/sessions.py): a real one-rank session
whose second case sleeps is stopped at its hang guard, keeps the case it finished, fails the
first test that needs an unfinished case with one line naming the session and the case, and
skips later ones with a short reference, instead of erroring every test of a module."""

from __future__ import annotations

import time

import pytest

from tests.helpers.distributed import timeout_scale
from tests.helpers.sessions import Case, SessionCases, SessionResult, run_session

# The worker's start-up (torch, titanlite: about 5 s) and one quick case fit in it; the test waits it out.
HANG_TIMEOUT_S = 15


def ready() -> str:
    return "ready"


def hang() -> None:
    time.sleep(3600)


@pytest.mark.timeout(HANG_TIMEOUT_S * timeout_scale() + 120)
def test_a_session_past_its_timeout_fails_one_test_in_one_line_naming_it(tmp_path):
    cases = [
        Case(name, [], call=f"{__name__}:{function}")
        for name, function in [("quick", "ready"), ("stuck", "hang"), ("never", "ready")]
    ]
    started = time.monotonic()
    results = SessionCases()
    results.add(run_session(1, cases, tmp_path / "sleepy", timeout=HANG_TIMEOUT_S))
    assert time.monotonic() - started < HANG_TIMEOUT_S * timeout_scale() + 60  # stopped, not waited for
    assert results["quick"]["checks"] == "ready"  # finished before the hang: kept

    with pytest.raises(pytest.fail.Exception) as first:
        results["stuck"]
    line = str(first.value)
    assert "\n" not in line, line
    assert line.startswith("session sleepy (1 ranks) timed out after "), line
    assert "in case stuck, 1 of 3 cases finished" in line, line

    with pytest.raises(pytest.skip.Exception) as later:
        results["never"]
    assert str(later.value).startswith("session sleepy (1 ranks) timed out") and "reported once" in str(later.value)


def test_a_session_that_finished_every_case_and_then_hung_fails_one_test():
    """Its results are all there, but a session that never exits costs its hang guard in every
    run: the first test to read it fails with the line, later ones read their cases."""
    line = "session world4 (4 ranks) timed out after 900 s (hang guard x 1.0 for this host's load): in case ?, 2 of 2"
    session = SessionResult({"a": {"error": None}, "b": {"error": None}}, names=["a", "b"], timed_out=line)
    with pytest.raises(pytest.fail.Exception) as first:
        session["a"]
    assert str(first.value) == line
    assert session["a"] == session["b"] == {"error": None}
