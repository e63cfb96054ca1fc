"""titanlite/observe/peak_flops.py: the peak MFU divides by. metrics.peak_flops wins; a GPU's
name finds its dense bf16 entry in the table (the most specific first, half of it for float32);
an unknown GPU or device gives no peak and says what to set; on CPU a matmul is measured (once
per host: tests/runs/test_precision.py's 2-process run checks that its ranks use one figure)."""

from __future__ import annotations

import pytest
import torch

from titanlite.observe import peak_flops as module
from titanlite.observe.peak_flops import PeakFlops, measure_cpu_matmul_flops, peak_flops

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu_named(monkeypatch):
    """The name the CUDA device reports (no GPU is needed: only the name is read)."""

    def set_name(name: str) -> None:
        monkeypatch.setattr(module.torch.cuda, "get_device_name", lambda device=None: name)

    return set_name


def test_the_configured_peak_wins_on_any_device(gpu_named):
    gpu_named("NVIDIA H100 80GB HBM3")
    for device in (CUDA, torch.device("cpu"), torch.device("meta")):
        assert peak_flops(device, torch.bfloat16, 1.5e14) == PeakFlops(1.5e14, "metrics.peak_flops")


@pytest.mark.parametrize(
    "name, bf16",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
    ],
)
def test_a_known_gpu_gets_its_table_entry_and_half_for_float32(gpu_named, name, bf16):
    gpu_named(name)
    peak = peak_flops(CUDA, torch.bfloat16, 0.0)
    assert peak == PeakFlops(bf16, f"{name}, dense bf16 peak from the table")
    tf32 = peak_flops(CUDA, torch.float32, 0.0)
    assert tf32.flops == bf16 / 2 and "TF32" in tf32.source


def test_every_table_entry_is_found_with_its_own_peak(gpu_named):
    """Entries that contain one another (H100 PCIe / H100, H200 / H20, L40S / L4) are looked up
    most specific first: each device name gets its own entry's peak."""
    for key, bf16 in module.GPU_BF16_PEAK_FLOPS:
        gpu_named(f"NVIDIA {key}")
        assert peak_flops(CUDA, torch.bfloat16, 0.0).flops == bf16, key


def test_an_unknown_gpu_or_device_gives_no_peak_and_says_what_to_set(gpu_named):
    gpu_named("Some Future GPU")
    unknown = peak_flops(CUDA, torch.bfloat16, 0.0)
    assert (
        unknown.flops is None
        and unknown.source == "Some Future GPU is not in the peak table; set metrics.peak_flops for MFU"
    )
    meta = peak_flops(torch.device("meta"), torch.bfloat16, 0.0)
    assert meta == PeakFlops(None, "no peak known for device type meta; set metrics.peak_flops for MFU")


def test_on_cpu_a_matmul_is_measured(monkeypatch):
    assert measure_cpu_matmul_flops(torch.float32, size=64, budget_s=0.0) > 0
    monkeypatch.setattr(module, "measure_cpu_matmul_flops", lambda dtype: 4.0e11)
    peak = peak_flops(torch.device("cpu"), torch.float32, 0.0)
    threads = torch.get_num_threads()
    assert peak == PeakFlops(
        4.0e11, f"torch.float32 matmul on {threads} thread(s), measured at start-up by local rank 0"
    )
