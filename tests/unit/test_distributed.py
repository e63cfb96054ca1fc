"""titanlite/parallel/distributed.py on one process: the process group's backend per device."""

from __future__ import annotations

from titanlite.parallel.distributed import backend_for


def test_the_backend_follows_the_device_and_cpu_offload():
    """NCCL cannot all-reduce the CPU gradients of an offloaded run: gloo serves CPU tensors
    beside it (no GPU here: the choice itself is what is checked)."""
    assert backend_for("cpu") == backend_for("cpu", cpu_offload=True) == "gloo"
    assert backend_for("cuda") == "nccl" and backend_for("cuda", cpu_offload=True) == "cuda:nccl,cpu:gloo"
