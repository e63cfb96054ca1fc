"""The training-state lower bound refuses layouts that cannot fit, before any allocation."""

from __future__ import annotations

import pytest
import torch

from titanlite.errors import TitanliteError
from titanlite.parallel.memory import TRAINING_STATE_BYTES_PER_PARAM, check_training_state_fits, host_memory_bytes

LLAMA_8B_PARAMS = 8_030_261_248


def test_8b_on_one_cpu_process_is_refused_with_the_numbers():
    with pytest.raises(TitanliteError) as error:
        check_training_state_fits(LLAMA_8B_PARAMS, 1, torch.device("cpu"), False, processes_per_host=1 << 20)
    message = str(error.value)
    assert message.startswith("parallelism: 8.03B parameters sharded 1 ways need at least 119.7 GiB per rank")
    assert "\n" not in message


def test_sharding_divides_the_requirement():
    per_process = host_memory_bytes() / 2
    fits = int(per_process / TRAINING_STATE_BYTES_PER_PARAM * 0.9)
    check_training_state_fits(fits, 1, torch.device("cpu"), False, processes_per_host=2)
    with pytest.raises(TitanliteError):
        check_training_state_fits(fits * 4, 1, torch.device("cpu"), False, processes_per_host=2)
    check_training_state_fits(fits * 4, 8, torch.device("cpu"), False, processes_per_host=2)
