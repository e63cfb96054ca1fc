"""A transformers model's sparse-MoE blocks as titanlite's MoE layer (models/moe.py), so that
expert parallelism, expert-bias balancing and the MoE metrics apply to them.

The types whose router titanlite's expresses are swapped: softmax scores, the top k, the
weights renormalized where the type does (Mixtral always, the others by `norm_topk_prob`) and
scaled by `routed_scaling_factor`, SwiGLU (SiLU) experts, shared experts added after; with two
experts per token the weighted sum is transformers' to the bit (tests/unit/test_hf_backend.py
checks the swapped layer against the block it replaces). Other MoE types (group-limited or
biased routing, router noise, other activations) keep transformers' own block: they train
under FSDP, PP and CP, and expert parallelism finds no layer to split.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from titanlite.models.moe import MoEArgs

SWAPPED_TYPES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v2")
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
"""config.json keys that give a mixture-of-experts model its routed experts."""


def moe_args(config: Any) -> MoEArgs | None:
    """titanlite's MoE layer for the config's sparse blocks; None when its type is not swapped."""
    routed = next((getattr(config, key) for key in EXPERT_COUNTS if getattr(config, key, None)), 0)
    plain = getattr(config, "topk_method", "greedy") == "greedy" and not getattr(config, "router_jitter_noise", 0)
    if config.model_type not in SWAPPED_TYPES or not routed or not plain or config.hidden_act != "silu":
        return None
    return MoEArgs(
        n_experts=routed,
        top_k=config.num_experts_per_tok,
        hidden_dim=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        n_shared_experts=getattr(config, "n_shared_experts", None) or 0,
        renormalize=bool(getattr(config, "norm_topk_prob", config.model_type == "mixtral")),
        route_scale=float(getattr(config, "routed_scaling_factor", None) or 1.0),
    )


def sparse_blocks(decoder: nn.Module) -> dict[int, nn.Module]:
    """The decoder's blocks whose feed-forward (`mlp`) holds routed experts, by index."""
    layers = decoder.layers.values() if isinstance(decoder.layers, nn.ModuleDict) else decoder.layers
    return {i: layer for i, layer in enumerate(layers) if hasattr(getattr(layer, "mlp", None), "experts")}
