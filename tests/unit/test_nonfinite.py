"""titanlite/step/nonfinite.py on one process: skips counted up to training.max_nan_skips, then
one line that names what was not finite; the NaN fault injection and its variable."""

from __future__ import annotations

import math

import pytest
import torch

from titanlite.errors import TitanliteError
from titanlite.step.agreement import StepAgreement
from titanlite.step.nonfinite import FAULT_NAN_ENV, NonFiniteError, NonFiniteSteps, inject_nan

FINE = StepAgreement(0, False, False)
BAD_LOSS = StepAgreement(0, True, False)
BAD_NORM = StepAgreement(0, False, True)


def test_no_skips_allowed_stops_at_the_first_with_one_line():
    steps = NonFiniteSteps(0, rank=0)
    assert steps.allows_update(1, FINE, torch.tensor(1.0))
    with pytest.raises(NonFiniteError) as error:
        steps.allows_update(2, BAD_LOSS, torch.tensor(1.0))
    assert str(error.value).startswith("step 2: non-finite loss; stopped before the optimizer step")
    assert "(0 of training.max_nan_skips 0 skips used)" in str(error.value)
    assert isinstance(error.value, TitanliteError)


def test_skips_are_counted_until_none_is_left():
    steps = NonFiniteSteps(2, rank=0)
    assert not steps.allows_update(3, BAD_NORM, torch.tensor(math.inf))
    assert not steps.allows_update(4, StepAgreement(0, True, True), torch.tensor(math.nan))
    assert steps.skipped == 2
    with pytest.raises(
        NonFiniteError, match=r"step 5: non-finite grad_norm \(inf\); .*\(2 of training.max_nan_skips 2 skips used\)"
    ):
        steps.allows_update(5, BAD_NORM, torch.tensor(math.inf))


def test_both_non_finite_are_named_in_one_line_on_every_rank():
    steps = NonFiniteSteps(0, rank=1)
    with pytest.raises(NonFiniteError) as error:
        steps.allows_update(7, StepAgreement(0, True, True), torch.tensor(math.nan))
    assert str(error.value).startswith("step 7: non-finite loss and grad_norm (nan); ") and "\n" not in str(error.value)
    assert steps.skipped == 0


def test_nan_injection_hits_only_its_step_and_rank(monkeypatch):
    loss = torch.tensor(2.0)
    monkeypatch.delenv(FAULT_NAN_ENV, raising=False)
    assert inject_nan(5, loss, here=True) is loss
    monkeypatch.setenv(FAULT_NAN_ENV, "5")
    assert torch.isnan(inject_nan(5, loss, here=True))
    assert inject_nan(5, loss, here=False) is loss and inject_nan(4, loss, here=True) is loss
    monkeypatch.setenv(FAULT_NAN_ENV, "five")
    with pytest.raises(TitanliteError, match=f"{FAULT_NAN_ENV}: expected a step number"):
        inject_nan(5, loss, here=True)
