"""checkpoint/checkpointer.py in one process: any model + optimizer + Stateful saved (async
or blocking), committed, retained, and loaded back exactly; bad arguments one line each.
The two-process resume and reshard are tests/runs/test_examples.py's."""

import pytest
import torch
from torch import nn

from tests.helpers.stand_ins import CountingLoader
from titanlite.checkpoint import commit
from titanlite.checkpoint.checkpointer import Checkpointer
from titanlite.errors import TitanliteError


def setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), CountingLoader()


def step(model, optimizer, counter):
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(counter.position))).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    counter.position += 1


@pytest.mark.parametrize("async_mode", ["async", "disabled"])
def test_a_save_resumes_exactly_and_retention_keeps_the_newest(tmp_path, async_mode):
    model, optimizer, counter = setup()
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, states={"counter": counter}, async_mode=async_mode, keep_latest_k=2
    ) as checkpointer:
        for n in range(1, 5):
            step(model, optimizer, counter)
            checkpointer.save(n)
    assert commit.scan(tmp_path).complete == (3, 4)
    for _ in range(2):
        step(model, optimizer, counter)
    expected = [p.detach().clone() for p in model.parameters()]

    model2, optimizer2, counter2 = setup(seed=1)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2, states={"counter": counter2}) as checkpointer:
        assert checkpointer.load() == 4
    assert counter2.position == 4
    for _ in range(2):
        step(model2, optimizer2, counter2)
    assert all(torch.equal(a, b) for a, b in zip(expected, model2.parameters()))


def test_an_empty_folder_loads_nothing_and_a_missing_step_is_one_line(tmp_path):
    model, _, _ = setup()
    with Checkpointer(tmp_path, model=model) as checkpointer:
        assert checkpointer.load() is None
        checkpointer.save(1, blocking=True)
        assert checkpointer.load(1) == 1
        with pytest.raises(TitanliteError, match="does not exist"):
            checkpointer.load(7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"async_mode": "later"}, "async_mode"),
        ({"keep_latest_k": -1}, "keep_latest_k"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"model": nn.Linear(1, 1), "states": {"model": CountingLoader()}}, "states key"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, kwargs, message):
    with pytest.raises(TitanliteError, match=f"^Checkpointer: {message}"):
        Checkpointer(tmp_path, **kwargs)
