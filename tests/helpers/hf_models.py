"""Tiny transformers models of many types, saved as HF folders for `--model.name hf` (the
config.json transformers writes, and the bundled sentencepiece tokenizer as tokenizer.model):
nothing is downloaded. Every config shares the tokenizer's 4,096 ids and a CPU-sized shape."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.helpers.distributed import REPO

SHAPE = dict(
    vocab_size=4096,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SMALL_FILES = 8 * 1024  # bytes a file: the tiny models spread over several
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# model_type -> (config class name, its arguments beside SHAPE)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "logits_scaling": 4.0, "residual_multiplier": 0.5}),
    "smollm3": ("SmolLM3Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, **MOE}),
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            **dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, **MOE),
            **dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
        },
    ),
}


def hf_folder(root: Path, model_type: str) -> Path:
    """`root`/`model_type`: a folder holding the tiny model's config.json and the tokenizer
    (written once; the same files every time)."""
    import transformers

    folder = root / model_type
    if not (folder / "config.json").exists():
        class_name, extra = CONFIGS[model_type]
        getattr(transformers, class_name)(**{**SHAPE, **extra}).save_pretrained(folder)
        shutil.copy(REPO / "assets" / "tokenizer" / "titanlite.model", folder / "tokenizer.model")
    return folder


def with_hf_folders(argv: list[str], root: Path) -> list[str]:
    """`argv` with each "hf:<model_type>" replaced by that model's folder under `root`, and each
    "chat:<file>" by that chat data file there (tests/helpers/chat_data.py)."""
    from tests.helpers.chat_data import chat_files

    def replaced(arg: str) -> str:
        if arg.startswith("hf:"):
            return str(hf_folder(root, arg[3:]))
        return str(chat_files(root)[arg[5:]]) if arg.startswith("chat:") else arg

    return [replaced(arg) for arg in argv]


def save_with_reference(model: torch.nn.Module, vocab_size: int, folder: Path, seed: int, max_shard_size: int) -> dict:
    """A transformers `model` saved in `folder/hf` as a user saves it, and its logits on fixed
    tokens in `folder/reference.pt` ({"tokens", "logits"}, also returned): the source folder of
    the family tests (hf_qwen3, hf_deepseek_v3, hf_gpt_oss)."""
    model.save_pretrained(folder / "hf", max_shard_size=max_shard_size)
    tokens = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        reference = {"tokens": tokens, "logits": model(tokens).logits}
    torch.save(reference, folder / "reference.pt")
    return reference


def folder_logits(folder: Path, tokens: torch.Tensor, dtype: torch.dtype = torch.float32, **load) -> torch.Tensor:
    """transformers' logits for a saved folder, whichever class its config names (`load`:
    from_pretrained's implementation choices)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **load).eval()
    with torch.no_grad():
        return model(tokens).logits
