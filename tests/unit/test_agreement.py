"""titanlite/step/agreement.py on one process: what every rank agrees on after backward (a
stop signal, a non-finite loss or grad norm), without a process group, on a one-rank gloo group,
and through the real all-reduce on that group (a world of one skips it, so the test spreads it)."""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist

from titanlite.step import agreement
from titanlite.step.agreement import StepAgreement, agree_on_step

NAN, INF = float("nan"), float("inf")


def test_the_agreement_says_what_it_holds():
    assert StepAgreement(0, False, False).finite and not StepAgreement(0, False, False).stop
    assert not StepAgreement(0, True, False).finite and not StepAgreement(0, False, True).finite
    stopped = StepAgreement(int(signal.SIGTERM), False, False)
    assert stopped.stop and stopped.stop_signal_name() == "SIGTERM"


@pytest.mark.parametrize(
    "stop, loss, norm, expected",
    [
        (0, 2.5, 1.0, StepAgreement(0, False, False)),
        (0, NAN, 1.0, StepAgreement(0, True, False)),
        (0, 2.5, INF, StepAgreement(0, False, True)),
        (int(signal.SIGUSR1), NAN, NAN, StepAgreement(int(signal.SIGUSR1), True, True)),
        (0, INF, 1.0, StepAgreement(0, True, False)),
        (0, 2.5, NAN, StepAgreement(0, False, True)),
        (int(signal.SIGTERM), 2.5, 1.0, StepAgreement(int(signal.SIGTERM), False, False)),
    ],
)
def test_one_process_agrees_with_itself(stop, loss, norm, expected):
    assert agree_on_step(stop, torch.tensor(loss), torch.tensor(norm)) == expected


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_all_reduce_path_gives_the_same_answer(one_rank_world):
    assert agree_on_step(int(signal.SIGTERM), torch.tensor(NAN), torch.tensor(3.0)) == StepAgreement(
        int(signal.SIGTERM), True, False
    )
    assert agree_on_step(0, torch.tensor(1.0), torch.tensor(1.0)) == StepAgreement(0, False, False)


def test_the_all_reduce_itself_carries_every_flag(one_rank_world, monkeypatch):
    """The MAX all-reduce runs on gloo (`_world` says yes, as at any world size above one) and every
    flag and the signal number come back as they went in."""
    monkeypatch.setattr(agreement, "_world", lambda: True)
    for stop, loss, norm in [(0, 2.5, 1.0), (0, NAN, 1.0), (0, 2.5, INF), (int(signal.SIGUSR1), INF, NAN)]:
        assert agree_on_step(stop, torch.tensor(loss), torch.tensor(norm)) == StepAgreement(
            stop, loss != 2.5, norm != 1.0
        )
