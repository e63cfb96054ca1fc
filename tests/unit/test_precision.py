"""`training.mixed_precision_param = "auto"` (issue: throughput, item 4; issue 41, item 3): bf16
where the hardware has bf16 units, float32 elsewhere, decided from what the hardware reports
(never a timing, so a loaded host decides as an idle one does), one decision for every rank,
said once with its reason.

The decision rule is checked with the host's answers stood in (no test may need a GPU, and
a CI host may lack bf16 units); the 2-process run checks what this host really picks and
that rank 0 says it once. bf16's numerics against float32 are tests/runs/test_mixed_precision.py's.
"""

from __future__ import annotations

import pytest
import torch

from titanlite.observe import peak_flops
from titanlite.step import precision

CPU = torch.device("cpu")


@pytest.fixture
def host(monkeypatch):
    """Set whether the CPU reports native bf16 matmuls."""

    def set_host(native: bool) -> None:
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)

    return set_host


def test_explicit_dtypes_are_kept(host):
    host(native=False)
    assert precision.decide_compute_dtype("bfloat16", CPU).name == "bfloat16"
    assert precision.decide_compute_dtype("float32", CPU).name == "float32"


@pytest.mark.parametrize("native, expected", [(False, "float32"), (True, "bfloat16")])
def test_auto_on_cpu_follows_native_bf16(host, native, expected):
    host(native)
    choice = precision.decide_compute_dtype("auto", CPU)
    assert choice.name == expected and choice.reason.startswith("auto: ")
    assert ("has native bf16" in choice.reason) == native and "AVX512-BF16 or AMX" in choice.reason


def test_auto_on_a_loaded_cpu_decides_as_on_an_idle_one(host, monkeypatch):
    """A matmul timing is what the load changes (bf16 timed at 0.75x float32 on a busy host):
    the decision must not read one, so the same host picks bf16 every time."""
    host(native=True)
    busy = {torch.bfloat16: 0.75e9, torch.float32: 1.0e9}
    monkeypatch.setattr(peak_flops, "measure_cpu_matmul_flops", lambda dtype, **_: busy[dtype])
    monkeypatch.setattr(precision, "measure_cpu_matmul_flops", lambda dtype, **_: busy[dtype], raising=False)
    choices = {precision.decide_compute_dtype("auto", CPU) for _ in range(3)}
    assert [choice.name for choice in choices] == ["bfloat16"], choices


@pytest.mark.parametrize(
    "capability, expected", [((7, 0), "float32"), ((7, 5), "float32"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16")]
)
def test_auto_on_gpu_follows_compute_capability(monkeypatch, capability, expected):
    """SM >= 8.0 has bf16 tensor cores; an older GPU emulates bf16 even where
    `torch.cuda.is_bf16_supported()` says True (it counts emulation)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    choice = precision.decide_compute_dtype("auto", torch.device("cuda"))
    assert choice.name == expected
    assert choice.reason == f"auto: this GPU is SM {capability[0]}.{capability[1]} (native bf16 from SM 8.0)"
