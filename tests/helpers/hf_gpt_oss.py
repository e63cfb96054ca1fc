"""Tiny gpt-oss models as transformers writes them (`save_pretrained`), with their logits on
fixed tokens: the Hugging Face source of the gpt-oss tests.

Four blocks (sliding, full, full, sliding: a `layer_types` other than the default) with a
window of 4 tokens over 16-token sequences (attended in chunks of 4 queries), GQA (4 heads,
2 kv heads), YaRN x4 with truncate false, 8 experts top 3 of the clamped SwiGLU. Every weight
is drawn (std 0.1; norms around 1; biases and sinks around 0 with std 0.5, so that sinks take
a visible share of each row), and the experts' input projection with std 1, so that their
pre-activations pass the clamp limit (set to 0.5 here): a dropped clamp, bias or sink changes
the logits."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.hf_models import SMALL_FILES, folder_logits, save_with_reference

from titanlite.models.gpt_oss import gpt_oss_hf as hf_adapter
from titanlite.models.gpt_oss.model import FULL, SLIDING, GptOssArgs, gpt_oss_moe
from titanlite.models.rope import YaRN

TINY = GptOssArgs(
    dim=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    vocab_size=64,
    moe=gpt_oss_moe(8, 16, top_k=3, clamped_swiglu=(1.702, 0.5)),
    window=4,
    layer_types=(SLIDING, FULL, FULL, SLIDING),
    rope_scaling=YaRN(factor=4.0, original_max_position_embeddings=16, truncate=False),
    max_seq_len=64,
)
# transformers' plain loop over the experts: its grouped_mm takes no float64
EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}


@torch.no_grad()
def randomize(named: dict[str, torch.Tensor], seed: int, std: float = 0.1) -> None:
    """Draw every tensor of `named` in place (either side's names, which agree on the words
    used here): norms 1 + N(0, std), biases and sinks N(0, 5 std), the experts' input
    projection N(0, 10 std), the rest N(0, std)."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in sorted(named.items()):
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.dtype)
        if "norm" in name:
            tensor.copy_(1.0 + std * noise)
        elif "bias" in name or "sinks" in name:
            tensor.copy_(5 * std * noise)
        elif name.endswith("gate_up_proj"):
            tensor.copy_(10 * std * noise)
        else:
            tensor.copy_(std * noise)


def transformers_model(args: GptOssArgs, seed: int = 0, std: float = 0.1, dtype: torch.dtype = torch.float32):
    """transformers' GptOssForCausalLM with these hyperparameters (through our config.json),
    every weight drawn (`randomize` at `std`), eval mode."""
    import transformers

    config = transformers.GptOssConfig.from_dict({**hf_adapter.hf_config(args), **EAGER})
    model = transformers.GptOssForCausalLM(config).to(dtype)
    randomize(dict(model.named_parameters()), seed, std)
    return model.eval()


def save_source(args: GptOssArgs, folder: Path, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """transformers' tiny model and its reference logits in `folder` (hf_models.save_with_reference)."""
    return save_with_reference(transformers_model(args, seed, dtype=dtype), args.vocab_size, folder, seed, SMALL_FILES)


def hf_logits(folder: Path, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' logits for a saved folder."""
    return folder_logits(folder, tokens, dtype, **EAGER)
