"""Refuse a layout whose training state cannot fit before allocating any of it.

A user who starts the 8B preset on one GPU should read one line saying how much memory
the sharded parameters, gradients and AdamW state need and how much the device has, not
an out-of-memory traceback minutes later from the first optimizer step. The estimate is a
lower bound (activations, buffers and allocator slack come on top), so passing it does not
promise a fit; failing it proves there is none.
"""

from __future__ import annotations

import os
import re

import torch

from titanlite.errors import TitanliteError

# fp32 master weights + fp32 gradients + AdamW exp_avg and exp_avg_sq.
TRAINING_STATE_BYTES_PER_PARAM = 4 + 4 + 8
GIB = 1024**3


# Memory of one device by `--gpu` name, in GiB: the capacity as torch reports it, rounded.
# The CUDA context and NCCL's buffers take 1-3 GiB of it.
GPU_MEMORY_GIB: dict[str, float] = {
    "A100-40GB": 40,
    "A100": 80,
    "H100": 80,
    "H100-NVL": 94,
    "H200": 140,
    "B200": 180,
    "MI300X": 192,
}
DEFAULT_GPU = "H100"
# Bytes per unit, lowercase: b, then kb .. tb (powers of 1000) and kib .. tib (of 1024).
_UNITS = {"b": 1} | {f"{p}{i}b": base**n for i, base in (("", 1000), ("i", 1024)) for n, p in enumerate("kmgt", 1)}


def parse_memory(text: str) -> int:
    """Bytes of a size such as "80GiB", "80 GB" or "1.5TiB" (the unit is required)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise TitanliteError(f"--device-memory: expected a size with a unit such as 80GiB or 80GB (got {text!r})")
    return int(float(match.group(1)) * unit)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_training_state_fits(
    n_params: int, shards: int, device: torch.device, offload_to_cpu: bool, processes_per_host: int
) -> None:
    """Raise when `n_params` of training state split over `shards` ranks exceeds what one
    rank has: its GPU's memory, or its share of host memory on CPU / with CPU offload."""
    needed = n_params * TRAINING_STATE_BYTES_PER_PARAM / shards
    if device.type == "cuda" and not offload_to_cpu:
        available, where = torch.cuda.get_device_properties(device).total_memory, f"{device} has"
    else:
        available = host_memory_bytes() / processes_per_host
        each_gets = f"each of the {processes_per_host} processes on this host gets"
        where = each_gets if processes_per_host > 1 else "this host has"
    if needed > available:
        raise TitanliteError(
            f"parallelism: {n_params / 1e9:,.2f}B parameters sharded {shards} ways need at least {needed / GIB:,.1f} "
            f"GiB per rank for fp32 weights, gradients and AdamW state, but {where} {available / GIB:,.1f} GiB; use "
            "more ranks (data_parallel_shard_degree, tensor_parallel_degree) or training.enable_cpu_offload"
        )


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    return _proc_status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """The most resident memory this process has had since start or `reset_peak_rss`."""
    return _proc_status_bytes("VmHWM")


def reset_peak_rss() -> None:
    """Restart the peak at the current resident memory, to measure one phase (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
