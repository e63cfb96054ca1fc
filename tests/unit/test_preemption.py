"""titanlite/runtime/preemption.py on one process: a stop signal is recorded (the first one
kept) for the step to finish, Ctrl-C stops at once, the previous handlers come back, and a
worker without a launcher keeps its own lifetime."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from titanlite.runtime.preemption import FORWARDED_SIGNALS, LAUNCHER_PID_ENV, StopSignals, die_with_launcher


@pytest.fixture
def signals():
    before = {sig: signal.getsignal(sig) for sig in (*FORWARDED_SIGNALS, signal.SIGINT)}
    received = StopSignals().install()
    yield received, before
    received.restore()


def test_stop_signals_are_recorded_and_the_first_is_kept(signals):
    received, _ = signals
    assert received.stop_signal == 0
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert received.stop_signal == signal.SIGUSR1 and not received.interrupted


def test_a_stop_signal_does_not_promise_a_checkpoint(signals, caplog, monkeypatch):
    """The same SIGTERM reaches the ranks left after a peer's kill -9, which save nothing."""
    monkeypatch.setattr(logging.getLogger("titanlite"), "propagate", True)  # off once init_logger ran
    with caplog.at_level(logging.INFO, logger="titanlite"):
        os.kill(os.getpid(), signal.SIGTERM)
    assert caplog.messages == [
        "got SIGTERM: stopping after this step (saved if checkpointing is on and every rank finishes it)"
    ]


def test_ctrl_c_interrupts_at_once(signals):
    received, _ = signals
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert received.interrupted


def test_restore_puts_the_previous_handlers_back(signals):
    received, before = signals
    assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    received.restore()
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_second_install_keeps_the_first_previous_handlers(signals):
    received, before = signals
    received.install()  # already installed: must not record its own handler as the previous one
    received.restore()
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_without_the_launcher_variable_the_worker_keeps_its_lifetime(monkeypatch):
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    die_with_launcher()  # nothing to follow: returns without touching the process
    assert os.getppid() > 0
