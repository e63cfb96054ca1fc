"""Llama <-> Hugging Face `LlamaForCausalLM`: parameter names, the RoPE layout, config.json.

Our attention follows Meta's reference code: RoPE rotates interleaved pairs (x0, x1),
(x2, x3), ... of each head. Hugging Face's Llama rotates halves (x_i, x_{i+d/2}). The two
compute the same function if the rows of wq and wk are permuted within each head so that
the pair (2i, 2i+1) lands at (i, i + d/2); that is what HF's own conversion script does
(`permute` in convert_llama_weights_to_hf.py). wk has n_kv_heads heads under GQA, so its
permutation uses n_kv_heads. wv, wo and the MLP have no rotary structure and keep their rows.

The functions take and return plain full (unsharded) state dicts; sharding is the
caller's business (see manager._load_hf and export.py). This module is the model's
`hf_adapter` (ModelSpec): to_hf, from_hf, hf_config, args_from_hf_config.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

# Our name (with {i} for the layer) -> Hugging Face name.
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}


def _compile(table: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile("^" + re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"), dst) for src, dst in table.items()]


_TO_HF = _compile(_NAMES)
_FROM_HF = _compile({v: k for k, v in _NAMES.items()})


def _rename(key: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, target in rules:
        match = pattern.match(key)
        if match:
            return target.replace("{i}", match.group(1)) if match.groups() else target
    raise KeyError(key)


def interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection, Meta's interleaved pairs -> HF's rotate-half order."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_half`."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    """Our full state dict -> Hugging Face names and layout (new tensors, inputs untouched).
    A tied model's head is its embedding table: HF stores it once, as `embed_tokens`."""
    out = {}
    for key, value in state_dict.items():
        if key == "output.weight" and args.tie_word_embeddings:
            continue
        name = _rename(key, _TO_HF)
        if key.endswith("attention.wq.weight"):
            value = interleaved_to_half(value, args.n_heads)
        elif key.endswith("attention.wk.weight"):
            value = interleaved_to_half(value, args.kv_heads)
        out[name] = value.contiguous()
    return out


def from_hf(state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    """Hugging Face names and layout -> our full state dict. HF's non-weight buffers
    (`rotary_emb.inv_freq` in old exports) are dropped; anything else unknown is an error.
    A tied model's `output.weight` is the embedding table (HF files may omit `lm_head`)."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        name = _rename(key, _FROM_HF)
        if name.endswith("attention.wq.weight"):
            value = half_to_interleaved(value, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            value = half_to_interleaved(value, args.kv_heads)
        out[name] = value.contiguous()
    if args.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """`config.json` for LlamaForCausalLM with these hyperparameters."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "rope_scaling": None,
    }
    if args.rope_scaling is not None:
        factor, low, high, original = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    return config


def args_from_hf_config(config: dict[str, Any], base: Any = None) -> Any:
    """LlamaArgs from a Hugging Face config.json (for `convert_hf.py from-hf`).

    `multiple_of` / `ffn_dim_multiplier` are not in HF configs; we pick values that
    reproduce `intermediate_size` exactly with Meta's rounding rule.
    """
    from titanlite.models.llama.model import LlamaArgs

    dim = config["hidden_size"]
    hidden = config["intermediate_size"]
    default = int(2 * (4 * dim) / 3)
    rope = config.get("rope_scaling")
    values = dict(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        multiple_of=hidden,
        ffn_dim_multiplier=None if default <= hidden else hidden / default,
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        rope_scaling=None
        if not rope
        else (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"])),
        max_seq_len=config.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    args = dataclasses.replace(base, **values) if base is not None else LlamaArgs(**values)
    if args.ffn_hidden_dim != hidden or args.head_dim != config.get("head_dim", args.head_dim):
        raise ValueError(f"config.json: intermediate_size {hidden} / head_dim cannot be expressed as a Llama flavor")
    return args
