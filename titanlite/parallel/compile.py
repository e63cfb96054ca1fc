"""torch.compile per transformer block, on CPU (Inductor's C++ backend) and on GPU (Triton)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from titanlite.parallel.units import replace

# Inductor has no code generation for complex numbers and warns once per graph; a complex
# op (Llama's RoPE multiply) then runs as its eager kernel, one vectorized pass already,
# and everything around it is still fused.
warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex operators")


def apply_compile(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
    """Compile each block ((qualified name, module)) on its own: repeated blocks share one
    compiled graph, and the FSDP hooks around each block stay outside the graphs."""
    for name, block in blocks:
        replace(model, name, torch.compile(block, fullgraph=True))
