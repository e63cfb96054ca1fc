"""torch.compile per transformer block."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> None:
    """Compile each block on its own: repeated blocks share one compiled graph, and the
    FSDP hooks around each block stay outside the graphs."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
