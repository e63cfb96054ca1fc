"""What the trainer needs to know about a model, so nothing outside `models/` names one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry.

    Contract for `model_class(args)`: `args` is a frozen dataclass with a `vocab_size`
    field; the module keeps its repeated blocks in `model.layers` (a ModuleDict), has
    `init_weights(seed)` that fills parameters identically for any parallel layout, and maps
    token ids [batch, seq] to logits [batch, seq, vocab].
    """

    name: str
    model_class: Callable[[Any], nn.Module]
    flavors: Mapping[str, Any]
    # (model, tp_mesh, loss_parallel, sequence_parallel) -> None: parallelize_module the model in place.
    apply_tp: Callable[[nn.Module, DeviceMesh, bool, bool], None]
    # (args, tp_degree) -> one message per size that does not split tp_degree ways.
    tp_problems: Callable[[Any, int], list[str]]
    # (args, n_params, seq_len) -> training FLOPs per token (forward + backward).
    flops_per_token: Callable[[Any, int, int], float]
    # Optional Hugging Face conversion: a module with to_hf(state_dict, args) / from_hf(...),
    # hf_config(args, dtype), check_hf_config(config, args) -> mismatches, args_from_hf_config,
    # and per key for sharded IO (checkpoint/hf_io.py): hf_name(key), tied_to(key, args),
    # rotary_heads(key, args), ignored_hf_tensor(name, args), interleaved_to_half(weight, heads).
    hf_adapter: Any = None

    def args_for(self, flavor: str, vocab_size: int) -> Any:
        return dataclasses.replace(self.flavors[flavor], vocab_size=vocab_size)


def transformer_flops_per_token(n_dense_params: int, n_layers: int, attn_width: int, seq_len: int) -> float:
    """6 FLOPs per weight per token (forward 2, backward 4) on every weight that does a
    matmul (the embedding lookup does not), plus causal-attention score and value matmuls:
    12 * layers * width * seq_len (PaLM's accounting, as torchtitan and Megatron report MFU)."""
    return 6 * n_dense_params + 12 * n_layers * attn_width * seq_len
