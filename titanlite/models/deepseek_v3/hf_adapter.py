"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM` (model_type "deepseek_v3"):
parameter names, the experts, config.json.

RoPE: our tables rotate interleaved pairs, and so do DeepSeek's weights (transformers'
`rope_interleave`, true in every DeepSeek-V3 config): q and k load by name alone. transformers
rotates the pairs and lays the result out half-split, ours keeps it interleaved; both apply
the same layout to q and k, so their products, and the logits, are the same.

The routed experts are stacked here, `experts.w1 [E, hidden, dim]` (w2, w3), and one tensor
per expert in HF's files (`model.layers.L.mlp.experts.E.gate_proj.weight`, up_proj for w3,
down_proj for w2), which transformers 5 writes and fuses on load (models/hf_names.py's
`MoEHFAdapterBase`): a rank reads and writes only its experts' slices. The router is
`mlp.gate.weight`, our expert bias its `e_score_correction_bias` (DeepSeek's balancing bias,
added to the scores for the choice only: the same rule as ours), the shared experts
`mlp.shared_experts.*`, dense blocks `mlp.gate_proj/up_proj/down_proj`.

Multi-token prediction: DeepSeek's files hold the MTP modules as layers past `num_hidden_layers`
(`model.layers.61.*` in the 671B), which are our MTP blocks' numbers too (model.py): the block's
own names, `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` (our block's `norm`), and copies of
the shared embedding and head (`embed_tokens`, `shared_head.head`), written again on save
(`copies`) and skipped on load. transformers drops those layers on load
(`_keys_to_ignore_on_load_unexpected`), so this adapter owns them; a model with fewer MTP
modules than a file (a flavor's `num_nextn_predict_layers`, which a config.json with a base
flavor does not change) skips the rest. Files in DeepSeek's fp8 format (`quantization_config`, with
`weight_scale_inv` tensors) are refused: dequantize them to bf16 first. `deepseek_v3_hf` is
the model's `hf_adapter` (ModelSpec); this module is the one place that knows DeepSeek-V3's config.json keys.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import torch

from titanlite.models.deepseek_v3.model_args import DeepSeekV3Args
from titanlite.models.hf_names import DECODER_NAMES, ROUTER_NAMES, MoEHFAdapterBase, decoder_hf_config, swiglu_names
from titanlite.models.moe import MoEArgs
from titanlite.models.rope import YaRN

_ATTENTION = "model.layers.{i}.self_attn"
_MLP = "model.layers.{i}.mlp"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COPIES = (".embed_tokens.weight", ".shared_head.head.weight")  # an MTP layer's shared embedding and head


class DeepSeekV3HFAdapter(MoEHFAdapterBase):
    """`DeepseekV3ForCausalLM` (ModelSpec.hf_adapter of deepseek_v3)."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("deepseek_v3",)
    EXPERT_BIAS_IN_HF = True
    NAMES: ClassVar[dict[str, str]] = {
        **DECODER_NAMES,
        **ROUTER_NAMES,
        "layers.{i}.attention.wq.weight": f"{_ATTENTION}.q_proj.weight",
        "layers.{i}.attention.wq_a.weight": f"{_ATTENTION}.q_a_proj.weight",
        "layers.{i}.attention.q_norm.weight": f"{_ATTENTION}.q_a_layernorm.weight",
        "layers.{i}.attention.wq_b.weight": f"{_ATTENTION}.q_b_proj.weight",
        "layers.{i}.attention.wkv_a.weight": f"{_ATTENTION}.kv_a_proj_with_mqa.weight",
        "layers.{i}.attention.kv_norm.weight": f"{_ATTENTION}.kv_a_layernorm.weight",
        "layers.{i}.attention.wkv_b.weight": f"{_ATTENTION}.kv_b_proj.weight",
        "layers.{i}.attention.wo.weight": f"{_ATTENTION}.o_proj.weight",
        "layers.{i}.feed_forward.expert_bias": f"{_MLP}.gate.e_score_correction_bias",
        **{
            f"layers.{{i}}.{name}.weight": f"model.layers.{{i}}.{name}.weight" for name in ("enorm", "hnorm", "eh_proj")
        },
        "layers.{i}.norm.weight": "model.layers.{i}.shared_head.norm.weight",
        **swiglu_names("layers.{i}.feed_forward.shared_experts", f"{_MLP}.shared_experts"),
    }

    def ignored_hf_tensor(self, name: str, args: DeepSeekV3Args) -> bool:
        """A tied model's duplicate head, the MTP layers' copies of the embedding and the head,
        and MTP layers past this model's (check_hf_config has matched num_hidden_layers, so a
        layer past it is one of those)."""
        index = int(layer.group(1)) if (layer := _LAYER.match(name)) else -1
        mtp_copy = index >= args.n_layers and name.endswith(_COPIES)
        return super().ignored_hf_tensor(name, args) or mtp_copy or index >= args.n_layers + args.mtp_depths

    def copies(self, key: str, args: DeepSeekV3Args) -> list[str]:
        """The embedding and the head, once more in each MTP layer (DeepSeek's layout)."""
        if (copy := {"tok_embeddings.weight": _COPIES[0], "output.weight": _COPIES[1]}.get(key)) is None:
            return []
        return [f"model.layers.{i}{copy}" for i in range(args.n_layers, args.n_layers + args.mtp_depths)]

    def hf_export_problems(self, args: DeepSeekV3Args) -> list[str]:
        """What of this flavor DeepseekV3ForCausalLM cannot hold (its MoE blocks: sigmoid scores,
        an expert bias, shared experts); empty: it maps."""
        moe = args.moe
        if moe is None:
            return []
        problems = {
            f"{moe.score_func} router scores (DeepSeek-V3's are a sigmoid)": moe.score_func != "sigmoid",
            "no expert bias (DeepSeek-V3's router has e_score_correction_bias)": not moe.use_expert_bias,
            "no shared experts (DeepSeek-V3's MoE blocks have n_shared_experts >= 1)": moe.n_shared_experts == 0,
        }
        return [what for what, present in problems.items() if present]

    def hf_config(self, args: DeepSeekV3Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """`config.json` for DeepseekV3ForCausalLM. RoPE is written both where transformers >= 5
        reads it (`rope_parameters`) and where older versions and DeepSeek's own code do
        (top-level `rope_theta`, `rope_scaling` with "type"). Without MoE every block is dense
        (first_k_dense_replace = the layers) and the MoE keys keep transformers' defaults."""
        yarn = None if args.rope_scaling is None else dataclasses.asdict(args.rope_scaling)
        config = {
            **decoder_hf_config(args, dtype, "DeepseekV3ForCausalLM", "deepseek_v3"),
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "head_dim": args.qk_rope_head_dim,  # what transformers sizes the RoPE table by
            "rope_scaling": None if yarn is None else {"type": "yarn", **yarn},
            "rope_parameters": {"rope_type": "default" if yarn is None else "yarn", "rope_theta": args.rope_theta}
            | (yarn or {}),
            "rope_interleave": True,
            "first_k_dense_replace": args.n_dense_layers if args.moe is not None else args.n_layers,
            "num_nextn_predict_layers": args.num_nextn_predict_layers,
        }
        if args.moe is not None:
            config.update({hf: getattr(args.moe, field) for field, hf in _MOE_FIELDS.items()})
            # DeepSeek's keys, which transformers does not read (its router is this one):
            # a flavor with another router (hf_export_problems) is told from HF's by them.
            config.update(scoring_func=args.moe.score_func, topk_method="noaux_tc")
        return config

    def described(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shapes, the latent ranks, norm eps, RoPE and YaRN (read from either place), the experts
                (None when every block is dense), their routing and which blocks have them, tied or biased
                weights, fp8 files; defaults filled in. The MTP depth is not among them: a model may load
        fewer MTP layers than a file has (`ignored_hf_tensor`)."""
        theta, yarn = rope_settings(config)
        heads, layers = config.get("num_attention_heads"), config.get("num_hidden_layers")
        described = {
            "model_type": config.get("model_type"),
            **{key: config.get(key) for key in ("hidden_size", "intermediate_size", "num_hidden_layers")},
            "num_attention_heads": heads,
            "num_key_value_heads": config.get("num_key_value_heads") or heads,
            "q_lora_rank": _value(config, "q_lora_rank") or 0,
            **{key: config.get(key) for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
            "vocab_size": config.get("vocab_size"),
            "rms_norm_eps": _value(config, "rms_norm_eps"),
            "rope_theta": theta,
            "rope_type": "default" if yarn is None else "yarn",
            **{f"rope_parameters.{key}": None if yarn is None else yarn[key] for key in _YARN_FIELDS},
            **{key: _value(config, key) for key in ("rope_interleave", "tie_word_embeddings", "attention_bias")},
            **{key: _value(config, key) for key in ("hidden_act", "scoring_func", "topk_method", "moe_layer_freq")},
            "quantization_config": (config.get("quantization_config") or {}).get("quant_method"),
        }
        dense = _value(config, "first_k_dense_replace") >= (layers or 0)
        described.update(
            {key: None if dense else _value(config, key) for key in (*_MOE_FIELDS.values(), "first_k_dense_replace")}
        )
        return described

    def compared(self, expected: dict[str, Any], got: dict[str, Any], args: DeepSeekV3Args) -> dict[str, Any]:
        """Also no YaRN fields when the RoPE types differ: the type says it; its fields would repeat it."""
        expected = super().compared(expected, got, args)
        if got["rope_type"] != expected["rope_type"]:
            expected = {key: value for key, value in expected.items() if not key.startswith("rope_parameters.")}
        return expected

    def args_from_hf_config(self, config: dict[str, Any], base: DeepSeekV3Args | None = None) -> DeepSeekV3Args:
        """DeepSeekV3Args from a Hugging Face config.json (for `convert_hf.py from-hf`), the MoE
        layer's training settings (bias step, aux loss) from `base` when given. KeyError or
        ValueError for a config this model cannot express."""
        if config.get("model_type") not in self.HF_MODEL_TYPES:
            raise ValueError(f"model_type {config.get('model_type')!r} is not DeepSeek-V3's ('deepseek_v3')")
        described = self.described(config)
        _refuse_what_this_model_lacks(described)
        yarn = {k: described[f"rope_parameters.{k}"] for k in _YARN_FIELDS}
        values = dict(
            **{key: config[hf] for key, hf in _SHAPES.items()},
            q_lora_rank=described["q_lora_rank"],
            norm_eps=described["rms_norm_eps"],
            rope_theta=described["rope_theta"],
            rope_scaling=None if described["rope_type"] == "default" else YaRN(**yarn),
            max_seq_len=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=described["tie_word_embeddings"],
            moe=None if described["first_k_dense_replace"] is None else _moe_from_hf_config(described, base),
            n_dense_layers=min(_value(config, "first_k_dense_replace"), config["num_hidden_layers"]),
        )
        if base is None:  # a base flavor keeps its MTP depth: the file's other MTP layers are skipped
            values["num_nextn_predict_layers"] = config.get("num_nextn_predict_layers", 0)
        return dataclasses.replace(base, **values) if base is not None else DeepSeekV3Args(**values)


# DeepSeekV3Args' shapes <- config.json's keys, which a config must have.
_SHAPES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    **{key: key for key in ("vocab_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    "hidden_dim": "intermediate_size",
}


# transformers' DeepseekV3Config defaults for the keys a config.json may leave out that
# change the model's function (the shapes have none worth guessing: a missing one is a
# mismatch, or a KeyError when converting).
_HF_DEFAULTS = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "q_lora_rank": 1536,
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
}


def _value(config: dict[str, Any], key: str) -> Any:
    """config.json's value of `key`, transformers' default when it has none."""
    return config.get(key, _HF_DEFAULTS.get(key))


_YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
# MoEArgs' routing fields <-> config.json's keys, in the order config.json has them.
_MOE_FIELDS = {
    "n_experts": "n_routed_experts",
    "top_k": "num_experts_per_tok",
    "hidden_dim": "moe_intermediate_size",
    "n_shared_experts": "n_shared_experts",
    "renormalize": "norm_topk_prob",
    "route_scale": "routed_scaling_factor",
    "n_group": "n_group",
    "topk_group": "topk_group",
}


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, float] | None]:
    """(rope_theta, the YaRN fields or None) wherever the config's transformers version put
    them (`rope_parameters` in >= 5, top-level `rope_theta` / `rope_scaling` before).
    ValueError for another RoPE scaling."""
    params = config.get("rope_parameters") or {}
    scaling = params if "rope_type" in params else (config.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(params.get("rope_theta", config.get("rope_theta") or _HF_DEFAULTS["rope_theta"]))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported (DeepSeek-V3 here has default or yarn RoPE)")
    yarn = {**_YARN_DEFAULTS, **{k: scaling[k] for k in _YARN_FIELDS if scaling.get(k) is not None}}
    if "factor" not in yarn or "original_max_position_embeddings" not in yarn:
        raise ValueError("yarn RoPE without factor or original_max_position_embeddings")
    if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
        raise ValueError("yarn attention_factor or truncate false (DeepSeek's YaRN: from mscale, truncated)")
    return theta, {k: float(v) if k != "original_max_position_embeddings" else int(v) for k, v in yarn.items()}


def _refuse_what_this_model_lacks(described: dict[str, Any]) -> None:
    quantized = described["quantization_config"]
    checks = {
        "num_key_value_heads != heads": described["num_key_value_heads"] == described["num_attention_heads"],
        "rope_interleave false (this model's RoPE rotates interleaved pairs)": described["rope_interleave"],
        "attention_bias true (this model's projections have no bias)": not described["attention_bias"],
        f"hidden_act {described['hidden_act']!r} (this model's MLPs are SwiGLU)": described["hidden_act"] == "silu",
        f"scoring_func {described['scoring_func']!r} (sigmoid here)": described["scoring_func"] == "sigmoid",
        f"topk_method {described['topk_method']!r} (noaux_tc here)": described["topk_method"] == "noaux_tc",
        f"moe_layer_freq {described['moe_layer_freq']} (1 here)": described["moe_layer_freq"] == 1,
        f"{quantized} quantized weights (dequantize them to bf16 first)": quantized is None,
    }
    if wrong := [what for what, ok in checks.items() if not ok]:
        raise ValueError(f"this DeepSeek-V3 cannot hold: {', '.join(wrong)}")


def _moe_from_hf_config(described: dict[str, Any], base: DeepSeekV3Args | None) -> MoEArgs:
    """DeepSeek-V3's MoE layer with the config's sizes and routing (`_described`); the
    training settings (bias step, aux loss) those of `base`'s MoE, or MoEArgs' defaults."""
    if missing := [hf for hf in list(_MOE_FIELDS.values())[:3] if not described[hf]]:  # the sizes
        raise KeyError(missing[0])
    sizes = {field: described[hf] for field, hf in _MOE_FIELDS.items()}
    sizes.update(renormalize=bool(sizes["renormalize"]), route_scale=float(sizes["route_scale"]))
    sizes.update(score_func="sigmoid", use_expert_bias=True)
    base_moe = getattr(base, "moe", None)
    return dataclasses.replace(base_moe, **sizes) if base_moe is not None else MoEArgs(**sizes)


deepseek_v3_hf = DeepSeekV3HFAdapter()
