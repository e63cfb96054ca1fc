"""titanlite/checkpoint/train_state.py: step, tokens seen and this rank's RNG state round-trip."""

from __future__ import annotations

import torch

from titanlite.checkpoint.train_state import TrainState, rng_key


def test_train_state_restores_step_tokens_and_rng():
    state = TrainState(step=7, tokens_seen=1234)
    torch.manual_seed(3)
    saved = state.state_dict()
    expected = torch.rand(4)
    fresh = TrainState()
    fresh.load_state_dict(saved)
    assert (fresh.step, fresh.tokens_seen) == (7, 1234)
    assert torch.equal(torch.rand(4), expected)
    assert set(saved) == {"step", "tokens_seen", rng_key(0)}
