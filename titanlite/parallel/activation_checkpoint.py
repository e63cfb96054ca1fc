"""Activation checkpointing: recompute in backward what forward would otherwise keep.

`activation_checkpoint.mode` (`apply_ac`'s setting in brackets):
- "full" ("full"): every block keeps only its input and recomputes the rest in backward;
- "selective" with `selective_ac_option` k (k): every k-th block, fully;
- "selective" with "op" ("op"): every block, per op (torch's selective-checkpoint API, torchtitan's
  policy): the outputs of matmuls (every other one), of attention and of the reduce-scatters
  TP issues are kept, the cheap elementwise ops (norms, activations, RoPE) recomputed. Most of
  full checkpointing's memory saving for a fraction of its recompute.

Wrapping keeps parameter names stable under the ModuleDict key, so checkpoints do not depend
on the AC setting (the wrapper's own prefix is stripped by DCP's state-dict APIs).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.parallel.units import replace


def _op(name: str):
    """An aten or c10d op by name, or None where this torch has no such op."""
    namespace, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), op.split(".")[0], None)
    return getattr(packet, op.split(".")[1], None) if packet is not None else None


# Ops whose outputs per-op AC keeps (matmuls: every other one), by name so a torch without
# one of them still runs: GPU and CPU attention kernels, TP's reduce-scatter, the max of the loss.
_SAVED_OP_NAMES = (
    "aten::mm.default",
    "aten::_scaled_dot_product_efficient_attention.default",
    "aten::_scaled_dot_product_flash_attention.default",
    "aten::_scaled_dot_product_cudnn_attention.default",
    "aten::_scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional::reduce_scatter_tensor.default",
    "aten::max.default",
)
SAVED_OPS = {op for op in map(_op, _SAVED_OP_NAMES) if op is not None}
_MM = _op("aten::mm.default")


def op_policy() -> Callable:
    """A fresh per-op policy (a forward and its recompute count their matmuls alike)."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == _MM:
            counts[mode] += 1
        keep = func in SAVED_OPS and not (func == _MM and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context():
    return create_selective_checkpoint_contexts(op_policy())


def ac_setting(mode: str, option: str) -> str | int:
    """The config's (`activation_checkpoint.mode`, `selective_ac_option`) as `apply_ac`'s one
    setting: "none", "full", "op", or k (every k-th block)."""
    if mode == "selective":
        return "op" if option == "op" else int(option)
    return mode


def apply_ac(model: nn.Module, ac: str | int, blocks: list[tuple[str, nn.Module]]) -> None:
    """Wrap `blocks` ((qualified name, module) in the model's order) as `ac` says: "none",
    "full" (every block), "op" (every block, per op) or k (every k-th block, fully)."""
    if ac == "none":
        return
    for index, (name, block) in enumerate(blocks):
        if ac == "op":
            replace(model, name, checkpoint_wrapper(block, context_fn=_op_context, preserve_rng_state=False))
        elif ac == "full" or (index + 1) % ac == 0:
            replace(model, name, checkpoint_wrapper(block, preserve_rng_state=False))
