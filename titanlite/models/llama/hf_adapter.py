"""Llama <-> Hugging Face `LlamaForCausalLM`: parameter names, the RoPE layout, config.json.

Our attention follows Meta's reference code: RoPE rotates interleaved pairs (x0, x1),
(x2, x3), ... of each head. Hugging Face's Llama rotates halves (x_i, x_{i+d/2}). The two
compute the same function if the rows of wq and wk are permuted within each head so that
the pair (2i, 2i+1) lands at (i, i + d/2); that is what HF's own conversion script does
(`permute` in convert_llama_weights_to_hf.py). wk has n_kv_heads heads under GQA, so its
permutation uses n_kv_heads. wv, wo and the MLP have no rotary structure and keep their rows.

`to_hf`/`from_hf` convert plain full state dicts; sharded loads and saves use the per-key
pieces (`hf_name`, `rotary_heads`, `tied_to`; nothing is stacked or zero for Llama) with
checkpoint/hf_io.py, which folds the row permutation into each rank's read plan. `llama3_hf`
is the model's `hf_adapter` (ModelSpec), the one place that knows Llama's config.json keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from titanlite.models.hf_names import DECODER_NAMES, GQA_NAMES, HFAdapterBase, decoder_described, decoder_hf_config
from titanlite.models.llama.model import LlamaArgs


class LlamaHFAdapter(HFAdapterBase):
    """`LlamaForCausalLM` (ModelSpec.hf_adapter of llama3)."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("llama",)
    MISSING_MODEL_TYPE = "llama"
    UNREADABLE = "RoPE settings"
    NAMES: ClassVar[dict[str, str]] = {**DECODER_NAMES, **GQA_NAMES}

    def rotary_heads(self, key: str, args: LlamaArgs) -> int | None:
        """The number of heads whose rows a projection's RoPE layout permutes (q: n_heads,
        k: kv_heads), or None for a tensor HF stores in our layout."""
        if key.endswith("attention.wq.weight"):
            return args.n_heads
        return args.kv_heads if key.endswith("attention.wk.weight") else None

    def ignored_hf_tensor(self, name: str, args: LlamaArgs) -> bool:
        """Old exports' RoPE buffers, and a tied model's duplicate head."""
        return name.endswith("rotary_emb.inv_freq") or super().ignored_hf_tensor(name, args)

    def hf_config(self, args: LlamaArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """`config.json` for LlamaForCausalLM with these hyperparameters. RoPE is written both
        where transformers >= 5 reads it (`rope_parameters`) and where older versions do
        (top-level `rope_theta`, `rope_scaling`), so either loads the same model."""
        scaling = None
        if args.rope_scaling is not None:
            scaling = {"rope_type": "llama3", **dict(zip(_LLAMA3_FIELDS, args.rope_scaling))}
        return {
            **decoder_hf_config(args, dtype, "LlamaForCausalLM", "llama"),
            "rope_scaling": scaling,
            "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": args.rope_theta},
            "mlp_bias": False,
        }

    @staticmethod
    def rope_settings(config: dict[str, Any]) -> tuple[float, tuple[float, float, float, int] | None]:
        """(rope_theta, llama3 scaling as LlamaArgs.rope_scaling or None) from a config.json,
        wherever its transformers version put them: `rope_parameters` (>= 5) or top-level
        `rope_theta` / `rope_scaling` (older; `type` before `rope_type`). ValueError for a
        RoPE this model does not implement."""
        params = config.get("rope_parameters") or {}
        if params and not ({"rope_type", "rope_theta"} & params.keys()):
            raise ValueError(f"rope_parameters per layer type ({', '.join(params)}) are not supported")
        theta = float(params.get("rope_theta", config.get("rope_theta") or _HF_DEFAULT_THETA))
        scaling = params if params.get("rope_type", "default") != "default" else (config.get("rope_scaling") or {})
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return theta, None
        if rope_type != "llama3":
            raise ValueError(f"rope type {rope_type!r} is not supported (default and llama3 are)")
        *factors, original = (scaling[field] for field in _LLAMA3_FIELDS)
        return theta, (*map(float, factors), int(original))

    def described(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shapes, norm eps, RoPE (read from either place), tied or biased weights."""
        theta, scaling = self.rope_settings(config)
        described = decoder_described(config, {"rope_theta": theta, "rope_scaling": scaling}, "llama")
        return {**described, "mlp_bias": bool(config.get("mlp_bias", False))}

    def args_from_hf_config(self, config: dict[str, Any], base: LlamaArgs | None = None) -> LlamaArgs:
        """LlamaArgs from a Hugging Face config.json (for `convert_hf.py from-hf`).

        `multiple_of` / `ffn_dim_multiplier` are not in HF configs; we pick values that
        reproduce `intermediate_size` exactly with Meta's rounding rule. KeyError or ValueError
        for a config this model cannot express.
        """
        described = self.described(config)
        dim, hidden = config["hidden_size"], config["intermediate_size"]
        default = int(2 * (4 * dim) / 3)
        values = dict(
            **self.decoder_values(config, described, 8192),
            vocab_size=config["vocab_size"],
            multiple_of=hidden,
            ffn_dim_multiplier=None if default <= hidden else hidden / default,
            rope_scaling=described["rope_scaling"],
        )
        args = dataclasses.replace(base, **values) if base is not None else LlamaArgs(**values)
        if unsupported := [key for key in ("attention_bias", "mlp_bias") if described[key]]:
            raise ValueError(f"{', '.join(unsupported)} true: this Llama has bias-free weights")
        if args.ffn_hidden_dim != hidden or args.head_dim != described["head_dim"]:
            raise ValueError(
                f"intermediate_size {hidden} / head_dim {described['head_dim']} cannot be expressed as a Llama flavor"
            )
        return args


# LlamaArgs.rope_scaling's fields, in order, as HF's llama3 `rope_parameters` name them.
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# transformers' LlamaConfig default, for a config.json without one.
_HF_DEFAULT_THETA = 10000.0

llama3_hf = LlamaHFAdapter()
