"""`training.mixed_precision_param = "auto"` (issue: throughput, item 4): bf16 only where it is
native and measured faster, float32 elsewhere, one decision for every rank, said once.

The decision rule is checked with the host's answers stood in (this CI's CPU has no bf16
units, and no test may need a GPU); the 2-process run checks what this host really picks
and that rank 0 says it once. bf16's numerics against float32 are tests/runs/test_mixed_precision.py's.
"""

from __future__ import annotations

import pytest
import torch

from titanlite.step import precision

CPU = torch.device("cpu")


@pytest.fixture
def host(monkeypatch):
    """Set what the CPU reports: native bf16 or not, and the measured bf16 / fp32 ratio."""

    def set_host(native: bool, speedup: float = 1.0) -> None:
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
        monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda: speedup)

    return set_host


def test_explicit_dtypes_are_kept(host):
    host(native=False)
    assert precision.decide_compute_dtype("bfloat16", CPU).name == "bfloat16"
    assert precision.decide_compute_dtype("float32", CPU).name == "float32"


@pytest.mark.parametrize(
    "native, speedup, expected",
    [
        (False, 4.0, "float32"),
        (True, 0.2, "float32"),
        (True, precision.MIN_BF16_SPEEDUP - 0.01, "float32"),
        (True, precision.MIN_BF16_SPEEDUP, "bfloat16"),
        (True, 3.5, "bfloat16"),
    ],
)
def test_auto_on_cpu_needs_native_and_fast_bf16(host, native, speedup, expected):
    host(native, speedup)
    choice = precision.decide_compute_dtype("auto", CPU)
    assert choice.name == expected and choice.reason.startswith("auto: ")


def test_auto_on_gpu_follows_bf16_support(monkeypatch):
    for supported, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda supported=supported: supported)
        assert precision.decide_compute_dtype("auto", torch.device("cuda")).name == expected
