"""Activation checkpointing: recompute blocks in backward instead of storing activations."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_ac(model: nn.Module, mode: str, every_k: int) -> None:
    """Wrap blocks in `model.layers`: all of them ("full") or every k-th ("selective").

    Wrapping keeps parameter names stable under the ModuleDict key, so checkpoints do not
    depend on the AC setting (the wrapper's own prefix is stripped by DCP's state-dict APIs).
    """
    if mode == "none":
        return
    for index, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or (index + 1) % every_k == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)

