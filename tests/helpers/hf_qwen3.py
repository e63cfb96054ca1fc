"""Tiny Qwen3 and Qwen3-MoE models as transformers writes them (`save_pretrained`, several
safetensors files), with their logits on fixed tokens: the Hugging Face source of the Qwen3
tests (unit, FSDP 2, trainer, generate). Weights drawn wider than transformers' 0.02, so the
routers choose decisively and the logits spread: 1e-6 differences between two exact
implementations move no top-k choice and no argmax."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.hf_models import SMALL_FILES, folder_logits, save_with_reference

from titanlite.models.qwen3 import Qwen3Args, qwen3_hf as hf_adapter, qwen3_moe

# Two blocks dense; three MoE blocks of 3 experts (top 2), the middle one dense
# (mlp_only_layers), so both feed-forwards of a Qwen3-MoE model are mapped. 3 experts: FSDP 2
# splits them unevenly by expert (2 and 1), FSDP 4 (more ranks than experts) by rows.
TINY = {
    "qwen3": Qwen3Args(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=48, vocab_size=64, max_seq_len=64
    ),
    "qwen3_moe": Qwen3Args(
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=48,
        vocab_size=64,
        max_seq_len=64,
        moe=qwen3_moe(3, 2, 24),
        mlp_only_layers=(1,),
    ),
}


def transformers_model(args: Qwen3Args, seed: int = 0, std: float = 0.1):
    """transformers' Qwen3ForCausalLM or Qwen3MoeForCausalLM with these hyperparameters
    (through our config.json), every weight but the norms' drawn with `std`, eval mode."""
    import transformers

    config = hf_adapter.hf_config(args)
    kind = transformers.Qwen3MoeForCausalLM if args.moe is not None else transformers.Qwen3ForCausalLM
    config_class = transformers.Qwen3MoeConfig if args.moe is not None else transformers.Qwen3Config
    torch.manual_seed(seed)
    model = kind(config_class.from_dict({**config, "attn_implementation": "eager"}))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if not name.endswith("norm.weight"):
                weight.normal_(0.0, std)
    return model.eval()


def save_source(
    args: Qwen3Args, folder: Path, seed: int = 0, max_shard_size: int = SMALL_FILES
) -> dict[str, torch.Tensor]:
    """transformers' tiny model and its reference logits in `folder` (hf_models.save_with_reference)."""
    return save_with_reference(transformers_model(args, seed), args.vocab_size, folder, seed, max_shard_size)


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits for a saved folder, whichever Qwen3 class its config names."""
    return folder_logits(folder, tokens, attn_implementation="eager")
