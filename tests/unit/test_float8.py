"""float8 training through torchao (`model.converters = ["float8"]`): what runs on this CPU."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

torchao_float8 = pytest.importorskip("torchao.float8")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_emulates_float8_training_on_cpu(recipe):
    """The feasibility check of issue 39 item 3: torchao 0.18's Float8Linear, emulated, runs
    forward and backward on this CPU, and its output and gradients are the float32 ones up to
    float8's rounding (e4m3 keeps 3 mantissa bits: 2**-4 relative per element at most)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 32, bias=False))
    reference = copy.deepcopy(model)
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    torchao_float8.convert_to_float8_training(model, config=config)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "ReLU", "Float8Linear"]
    x = torch.randn(16, 64)
    out, expected = model(x), reference(x)
    out.square().sum().backward()
    expected.square().sum().backward()

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    assert 0 < relative(out, expected) < 0.1
    for converted, plain in zip(model[::2], reference[::2]):
        assert 0 < relative(converted.weight.grad, plain.weight.grad) < 0.25
