"""Tiny DeepSeek-V3 models as transformers writes them (`save_pretrained`, several
safetensors files), with their logits on fixed tokens: the Hugging Face source of the
DeepSeek-V3 tests (unit, FSDP 2 and ep 2, trainer, generate).

Two shapes, one per query path: the low-rank queries (q_lora_rank > 0) with YaRN RoPE
(mscale unlike mscale_all_dim, so both of its corrections act), and the plain query
projection (q_lora_rank 0) with default RoPE. Both have a dense first block, then MoE blocks
of 8 experts in 4 groups (each token's top 3 among its best 2 groups), a shared expert,
sigmoid scores, routed scaling and an expert bias. Every weight is drawn (std 0.1), the
norms around 1 and the expert bias around 0, so that a swapped or dropped tensor changes
the logits; the routers then choose decisively: 1e-6 differences between two exact
implementations move no top-k choice and no argmax."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.hf_models import SMALL_FILES, folder_logits, save_with_reference

from titanlite.models.deepseek_v3 import deepseek_v3_hf as hf_adapter
from titanlite.models.deepseek_v3.model import DeepSeekV3Args
from titanlite.models.moe import MoEArgs
from titanlite.models.rope import YaRN

MOE = MoEArgs(
    n_experts=8,
    top_k=3,
    hidden_dim=16,
    n_shared_experts=1,
    score_func="sigmoid",
    renormalize=True,
    route_scale=2.5,
    use_expert_bias=True,
    n_group=4,
    topk_group=2,
)
_SHAPE = dict(
    dim=32,
    n_layers=3,
    n_heads=4,
    vocab_size=64,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    hidden_dim=48,
    moe=MOE,
    n_dense_layers=1,
    max_seq_len=64,
)
TINY = {
    "q_lora": DeepSeekV3Args(
        **_SHAPE,
        q_lora_rank=24,
        rope_scaling=YaRN(factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.8),
    ),
    "plain_q": DeepSeekV3Args(**_SHAPE, q_lora_rank=0),
}


@torch.no_grad()
def randomize(named: dict[str, torch.Tensor], seed: int, std: float = 0.1) -> None:
    """Draw every tensor of `named` in place (a model's parameters and expert biases, either
    side's names): norms 1 + N(0, std), expert biases N(0, std / 2), the rest N(0, std)."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in sorted(named.items()):
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.dtype)
        if "norm" in name:
            tensor.copy_(1.0 + std * noise)
        elif "bias" in name:
            tensor.copy_(std / 2 * noise)
        else:
            tensor.copy_(std * noise)


def transformers_model(args: DeepSeekV3Args, seed: int = 0, std: float = 0.1, dtype: torch.dtype = torch.float32):
    """transformers' DeepseekV3ForCausalLM with these hyperparameters (through our
    config.json), every weight and expert bias drawn (`randomize`), eval mode."""
    import transformers

    # transformers' plain loop over the experts: its grouped_mm takes no float64
    eager = {"attn_implementation": "eager", "experts_implementation": "eager"}
    config = transformers.DeepseekV3Config.from_dict({**hf_adapter.hf_config(args), **eager})
    model = transformers.DeepseekV3ForCausalLM(config).to(dtype)
    tensors = dict(model.named_parameters())
    tensors.update({name: b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")})
    randomize(tensors, seed, std)
    return model.eval()


def save_source(
    args: DeepSeekV3Args, folder: Path, seed: int = 0, max_shard_size: int = SMALL_FILES, dtype=torch.float32
) -> dict[str, torch.Tensor]:
    """transformers' tiny model and its reference logits in `folder` (hf_models.save_with_reference)."""
    return save_with_reference(
        transformers_model(args, seed, dtype=dtype), args.vocab_size, folder, seed, max_shard_size
    )


def hf_logits(folder: Path, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' logits for a saved folder."""
    return folder_logits(folder, tokens, dtype, attn_implementation="eager", experts_implementation="eager")
