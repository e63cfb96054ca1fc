"""gpt-oss <-> Hugging Face `GptOssForCausalLM` (model_type "gpt_oss"): names and config.json.

Our gpt-oss holds every tensor in HF's layout, so the mapping is names alone and each rank
reads and writes only its slices (checkpoint/hf_io.py): RoPE rotates HF's halves, and the
experts are stacked as HF stores them (`mlp.experts.gate_up_proj [E, dim, 2 * hidden]`, gate
and up columns interleaved, `gate_up_proj_bias`, `down_proj [E, hidden, dim]`,
`down_proj_bias`; moe_experts.ClampedSwiGLUExperts). The router is `mlp.router` (weight and
bias), the sinks `self_attn.sinks`.

The published checkpoints store the experts in MXFP4 (`*_blocks` / `*_scales` tensors, a
`quantization_config` with quant_method "mxfp4"): refused in one line (the config names it;
a folder of such tensors without it is missing `gate_up_proj`). Dequantize to bf16 first
(transformers' `Mxfp4Config(dequantize=True)`, or the published BF16 copies).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from titanlite.models.gpt_oss.model import FULL, SLIDING, GptOssArgs, gpt_oss_moe
from titanlite.models.hf_names import DECODER_NAMES, GQA_NAMES, HFAdapterBase, decoder_described, decoder_hf_config
from titanlite.models.rope import YaRN

_ATTENTION, _MLP = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
# HF's GptOssConfig defaults for what a config.json may leave out.
_ROPE_DEFAULT = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
_ROPE_DEFAULT["original_max_position_embeddings"] = 4096
_YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")


class GptOssHFAdapter(HFAdapterBase):
    """`GptOssForCausalLM` (ModelSpec.hf_adapter of gpt_oss)."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gpt_oss",)
    UNREADABLE = "RoPE settings"
    NAMES: ClassVar[dict[str, str]] = {
        **DECODER_NAMES,
        **GQA_NAMES,
        **{f"layers.{{i}}.attention.w{x}.bias": f"{_ATTENTION}.{x}_proj.bias" for x in "qkvo"},
        "layers.{i}.attention.sinks": f"{_ATTENTION}.sinks",
        "layers.{i}.feed_forward.router.gate.weight": f"{_MLP}.router.weight",
        "layers.{i}.feed_forward.router.gate.bias": f"{_MLP}.router.bias",
        **{f"layers.{{i}}.feed_forward.experts.{name}": f"{_MLP}.experts.{name}" for name in _EXPERTS},
    }

    def hf_export_problems(self, args: GptOssArgs) -> list[str]:
        """What of this flavor GptOssForCausalLM cannot hold (its router is a biased softmax
        top-k, renormalized, its experts the clamped SwiGLU); empty: it maps."""
        moe = args.moe
        absent = {
            "an expert bias (MoEArgs.use_expert_bias)": moe.use_expert_bias,
            "shared experts": moe.n_shared_experts > 0,
            "group-limited routing": moe.n_group > 1,
            f"{moe.score_func} router scores, not renormalized, or scaled": (
                moe.score_func != "softmax" or not moe.renormalize or moe.route_scale != 1.0
            ),
            "a router without bias or plain SwiGLU experts": not moe.router_bias or moe.clamped_swiglu is None,
        }
        return [f"{what} (gpt-oss has none)" for what, present in absent.items() if present]

    def hf_config(self, args: GptOssArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """`config.json` for GptOssForCausalLM; RoPE under `rope_parameters` (transformers >= 5)."""
        yarn = args.rope_scaling
        rope = (
            {"rope_type": "default"}
            if yarn is None
            else {"rope_type": "yarn"} | {key: getattr(yarn, key) for key in _YARN_FIELDS}
        )
        alpha, limit = args.moe.clamped_swiglu
        return {
            **decoder_hf_config(args, dtype, "GptOssForCausalLM", "gpt_oss"),
            "attention_bias": True,
            "rope_parameters": {**rope, "rope_theta": args.rope_theta},
            "sliding_window": args.window,
            "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
            "num_local_experts": args.moe.n_experts,
            "num_experts_per_tok": args.moe.top_k,
            "swiglu_alpha": alpha,
            "swiglu_limit": limit,
            "router_aux_loss_coef": args.moe.aux_loss_coef,
            "output_router_logits": False,
        }

    def described(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shapes, norm eps, RoPE and YaRN (either place), biases, windows and layer types, the
        experts and their SwiGLU, MXFP4 files; transformers' defaults filled in."""
        layers = config.get("num_hidden_layers") or 0
        default_types = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
        return {
            **decoder_described(config, _rope(config)),
            "attention_bias": bool(config.get("attention_bias", True)),
            "sliding_window": config.get("sliding_window", 128),
            "layer_types": list(config.get("layer_types") or default_types),
            "num_local_experts": config.get("num_local_experts", config.get("num_experts")),
            "num_experts_per_tok": config.get("num_experts_per_tok", 4),
            "swiglu_alpha": config.get("swiglu_alpha", 1.702),
            "swiglu_limit": config.get("swiglu_limit", 7.0),
            "quantization_config": (config.get("quantization_config") or {}).get("quant_method"),
        }

    def args_from_hf_config(self, config: dict[str, Any], base: GptOssArgs | None = None) -> GptOssArgs:
        """GptOssArgs from a Hugging Face config.json (the MoE layer's training settings from
        `base` when given). KeyError or ValueError for a config this model cannot express."""
        if config.get("model_type") not in self.HF_MODEL_TYPES:
            raise ValueError(f"model_type {config.get('model_type')!r} is not gpt-oss's ('gpt_oss')")
        d = self.described(config)
        wrong = {
            f"{d['quantization_config']} quantized experts (dequantize them to bf16 first)": d["quantization_config"],
            "attention_bias false": not d["attention_bias"],
            "tie_word_embeddings true": d["tie_word_embeddings"],
        }
        if problems := [what for what, present in wrong.items() if present]:
            raise ValueError(f"this gpt-oss cannot hold: {', '.join(problems)}")
        sizes = {"n_experts": d["num_local_experts"], "top_k": d["num_experts_per_tok"]}
        sizes["hidden_dim"] = d["intermediate_size"]
        moe = base.moe if base is not None else gpt_oss_moe(sizes["n_experts"], sizes["hidden_dim"])
        default_types = [SLIDING if i % 2 == 0 else FULL for i in range(config["num_hidden_layers"])]
        values = dict(
            **self.decoder_values(config, d, 131072),
            head_dim=d["head_dim"],
            vocab_size=config["vocab_size"],
            window=d["sliding_window"],
            layer_types=() if d["layer_types"] == default_types else tuple(d["layer_types"]),
            rope_scaling=_yarn(d),
            moe=dataclasses.replace(moe, **sizes, clamped_swiglu=(d["swiglu_alpha"], d["swiglu_limit"])),
        )
        del values["tie_word_embeddings"]
        return dataclasses.replace(base, **values) if base is not None else GptOssArgs(**values)


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, the RoPE type and YaRN's fields wherever the config's transformers version put
    them (`rope_parameters`, or top-level `rope_theta` / `rope_scaling` as the published files)."""
    params = config.get("rope_parameters") or {}
    scaling = params if "rope_type" in params else (config.get("rope_scaling") or _ROPE_DEFAULT)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"rope type {kind!r} is not supported (gpt-oss here has yarn or default RoPE)")
    theta = float(params.get("rope_theta", config.get("rope_theta", 150000.0)))
    yarn = {f"rope.{key}": scaling.get(key, _ROPE_DEFAULT[key]) if kind == "yarn" else None for key in _YARN_FIELDS}
    return {"rope_theta": theta, "rope_type": kind, **yarn}


def _yarn(described: dict[str, Any]) -> YaRN | None:
    if described["rope_type"] == "default":
        return None
    values = {key: described[f"rope.{key}"] for key in _YARN_FIELDS}
    values["original_max_position_embeddings"] = int(values["original_max_position_embeddings"])
    return YaRN(**{key: float(v) if key in ("factor", "beta_fast", "beta_slow") else v for key, v in values.items()})


gpt_oss_hf = GptOssHFAdapter()
