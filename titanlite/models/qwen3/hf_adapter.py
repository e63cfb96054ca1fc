"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM` (model_type "qwen3") and Qwen3-MoE <->
`Qwen3MoeForCausalLM` ("qwen3_moe"): parameter names, the experts, config.json.

Our Qwen3 rotates RoPE in HF's half layout, so q and k load by name alone (no row
permutation, unlike Llama). The one layout that differs is the routed experts: we hold an
MoE layer's experts stacked, `experts.w1 [E, hidden, dim]` (and w2, w3), while HF's files
hold one tensor per expert, `model.layers.L.mlp.experts.E.gate_proj.weight [hidden, dim]`
(up_proj for w3, down_proj for w2): the names transformers 5 writes with `save_pretrained`
(it computes with fused `gate_up_proj` tensors in memory and converts back on save) and the
published Qwen3-MoE checkpoints hold (models/hf_names.py's `MoEHFAdapterBase`). The router is
`mlp.gate.weight`.

HF's Qwen3-MoE has no expert bias (DeepSeek-V3's balancing, which our debug MoE flavor
trains): loading from HF zeroes it (`zero_in_hf`: a zero bias routes as HF routes), and a
flavor with one cannot be written as HF weights (`hf_export_problems`), nor can shared
experts, sigmoid scores or a routed scale. `qwen3_hf` is the model's `hf_adapter` (ModelSpec);
this module is the one place that knows Qwen3's config.json keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from titanlite.models.hf_names import (
    DECODER_NAMES,
    ROUTER_NAMES,
    GQA_NAMES,
    MoEHFAdapterBase,
    decoder_described,
    decoder_hf_config,
)
from titanlite.models.moe import MoEArgs
from titanlite.models.qwen3.model import Qwen3Args, qwen3_moe

# transformers' default, for a config.json without one.
_HF_DEFAULT_THETA = 10000.0


class Qwen3HFAdapter(MoEHFAdapterBase):
    """`Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` (ModelSpec.hf_adapter of qwen3)."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3", "qwen3_moe")
    UNREADABLE = "RoPE settings"
    EXPERT_BIAS_IN_HF = False
    NAMES: ClassVar[dict[str, str]] = {
        **DECODER_NAMES,
        **ROUTER_NAMES,
        **GQA_NAMES,
        "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
        "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    }

    def hf_export_problems(self, args: Qwen3Args) -> list[str]:
        """What of this flavor Qwen3MoeForCausalLM cannot hold (its routing is a softmax top-k,
        optionally renormalized, with no bias, shared experts or scale); empty: it maps."""
        moe = args.moe
        if moe is None:
            return []
        absent = {
            "an expert bias (DeepSeek-V3's balancing; MoEArgs.use_expert_bias)": moe.use_expert_bias,
            f"{moe.n_shared_experts} shared experts": moe.n_shared_experts > 0,
            f"routed_scaling_factor {moe.route_scale}": moe.route_scale != 1.0,
        }
        problems = [f"{what} (Qwen3-MoE has none)" for what, present in absent.items() if present]
        if moe.score_func != "softmax":
            problems.append(f"{moe.score_func} router scores (Qwen3-MoE's are a softmax)")
        return problems

    def hf_config(self, args: Qwen3Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """`config.json` for Qwen3ForCausalLM, or Qwen3MoeForCausalLM when the flavor has MoE
        layers. RoPE is written both where transformers >= 5 reads it (`rope_parameters`) and
        where older versions do (top-level `rope_theta`)."""
        moe = args.moe
        architecture, model_type = ("Qwen3MoeForCausalLM", "qwen3_moe") if moe else ("Qwen3ForCausalLM", "qwen3")
        config = {
            **decoder_hf_config(args, dtype, architecture, model_type),
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "use_sliding_window": False,
        }
        if moe is not None:
            config.update(
                num_experts=moe.n_experts,
                num_experts_per_tok=moe.top_k,
                moe_intermediate_size=moe.hidden_dim,
                norm_topk_prob=moe.renormalize,
                router_aux_loss_coef=moe.aux_loss_coef,
                decoder_sparse_step=args.decoder_sparse_step,
                mlp_only_layers=list(args.mlp_only_layers),
                output_router_logits=False,
            )
        return config

    def described(self, config: dict[str, Any]) -> dict[str, Any]:
        """The model type (dense or MoE), shapes, norm eps, RoPE (read from either place), tied or
        biased weights, sliding windows, the experts and which blocks have them (the aux loss
        coefficient, a training setting, is not among them)."""
        described = {
            **decoder_described(config, {"rope_theta": rope_theta(config)}),
            "use_sliding_window": bool(config.get("use_sliding_window", False)),
        }
        if config.get("model_type") == "qwen3_moe":
            described.update(
                {key: config.get(key) for key in ("num_experts_per_tok", "moe_intermediate_size")},
                num_experts=_expert_count(config),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                decoder_sparse_step=config.get("decoder_sparse_step", 1),
                mlp_only_layers=sorted(config.get("mlp_only_layers") or []),
            )
        return described

    def args_from_hf_config(self, config: dict[str, Any], base: Qwen3Args | None = None) -> Qwen3Args:
        """Qwen3Args from a Hugging Face config.json (for `convert_hf.py from-hf`): a dense
        Qwen3, or Qwen3-MoE's layer (`qwen3_moe`, or `base`'s MoE settings, its expert bias
        included, with the config's sizes). KeyError or ValueError for a config this model
        cannot express."""
        if config.get("model_type") not in self.HF_MODEL_TYPES:
            raise ValueError(f"model_type {config.get('model_type')!r} is not Qwen3's ('qwen3' or 'qwen3_moe')")
        described = self.described(config)
        if unsupported := [key for key in ("attention_bias", "use_sliding_window") if described[key]]:
            raise ValueError(f"{', '.join(unsupported)} true: this Qwen3 has bias-free, full attention")
        values = dict(
            **self.decoder_values(config, described, 40960),
            head_dim=described["head_dim"],
            hidden_dim=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            moe=None,
        )
        if config["model_type"] == "qwen3_moe":
            values.update(_moe_values(config, described, base))
        return dataclasses.replace(base, **values) if base is not None else Qwen3Args(**values)


def _moe_values(config: dict[str, Any], described: dict[str, Any], base: Qwen3Args | None) -> dict[str, Any]:
    """Qwen3-MoE's layer with the config's sizes: `qwen3_moe`, or `base`'s MoE settings (its
    expert bias included), and which blocks have it."""
    if _expert_count(config) is None:
        raise KeyError("num_experts")
    sizes = dict(
        n_experts=_expert_count(config),
        top_k=config["num_experts_per_tok"],
        hidden_dim=config["moe_intermediate_size"],
        renormalize=described["norm_topk_prob"],
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
    )
    base_moe: MoEArgs = getattr(base, "moe", None) or qwen3_moe(sizes["n_experts"], sizes["top_k"], sizes["hidden_dim"])
    return dict(
        moe=dataclasses.replace(base_moe, **sizes),
        decoder_sparse_step=described["decoder_sparse_step"],
        mlp_only_layers=tuple(described["mlp_only_layers"]),
    )


def rope_theta(config: dict[str, Any]) -> float:
    """rope_theta wherever the config's transformers version put it (`rope_parameters` in
    >= 5, top level before). ValueError for a RoPE scaling (yarn, ...): ours has none."""
    params = config.get("rope_parameters") or {}
    scaling = params if "rope_type" in params else (config.get("rope_scaling") or {})
    if (kind := scaling.get("rope_type", scaling.get("type", "default"))) != "default":
        raise ValueError(f"rope type {kind!r} is not supported (Qwen3 here has default RoPE only)")
    return float(params.get("rope_theta", config.get("rope_theta") or _HF_DEFAULT_THETA))


def _expert_count(config: dict[str, Any]) -> int | None:
    """The routed experts per layer: `num_experts` in the published Qwen3-MoE configs,
    `num_local_experts` in what transformers >= 5.2x writes (its attribute map's name)."""
    return config.get("num_experts", config.get("num_local_experts"))


qwen3_hf = Qwen3HFAdapter()
