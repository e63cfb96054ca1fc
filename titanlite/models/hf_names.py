"""What every family's Hugging Face adapter (its hf_adapter.py) shares: names both ways from one
table of patterns (`{i}` in a name stands for a layer number, which the rename carries over), the
`HFAdapter` answers that follow from the table, the routed experts' names for MoE families
(`MoEHFAdapterBase`), and the config.json keys every decoder family writes alike.

An adapter subclasses `HFAdapterBase` (or `MoEHFAdapterBase`), gives `NAMES` and its config.json
(`hf_config`, `described`, `args_from_hf_config`), and overrides the per-key answers that differ
from the defaults: a head tied to the embedding stored once, nothing stacked, rotated or zero.
`to_hf` and `from_hf` are built from those answers, so the whole-dict conversion and the sharded
IO (checkpoint/hf_io.py, which asks per key) cannot disagree.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch

from titanlite.config.dtypes import dtype_name
from titanlite.model_spec import DecoderArgs, HFAdapter
from titanlite.models.decoder import DecoderModelArgs


def _compile(table: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile("^" + re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"), dst) for src, dst in table.items()]


def _rename(key: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, target in rules:
        if match := pattern.match(key):
            return target.replace("{i}", match.group(1)) if match.groups() else target
    raise KeyError(key)


# A SwiGLU's weights (models/decoder.py's FeedForward, and each routed expert's) -> HF's MLP projections.
SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def swiglu_names(ours: str, hf: str) -> dict[str, str]:
    """The three weights of our SwiGLU module `ours` <-> those of HF's MLP module `hf`."""
    return {f"{ours}.{w}.weight": f"{hf}.{proj}.weight" for w, proj in SWIGLU.items()}


# The shared decoder's names (models/decoder.py) in HF's Llama-shaped layout, and its GQA attention's.
DECODER_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **swiglu_names("layers.{i}.feed_forward", "model.layers.{i}.mlp"),
}
GQA_NAMES = {f"layers.{{i}}.attention.w{x}.weight": f"model.layers.{{i}}.self_attn.{x}_proj.weight" for x in "qkvo"}


class HFAdapterBase(HFAdapter):
    """The table-driven half of a family's adapter; see the module docstring."""

    NAMES: ClassVar[dict[str, str]]  # our name (with {i} for the layer) -> HF's, for tensors stored whole
    MISSING_MODEL_TYPE: ClassVar[str | None] = None  # the model_type of a config.json without one
    UNREADABLE: ClassVar[str] = "settings"  # what check_hf_config calls a config.json `described` cannot read
    HEAD: ClassVar[str] = "output.weight"  # our output head's key, and the embedding table's
    EMBEDDING: ClassVar[str] = "tok_embeddings.weight"

    def __init__(self) -> None:
        # Our state-dict key <-> its Hugging Face name, for every pattern of NAMES, both ways.
        self._to_hf = _compile(self.NAMES)
        self._from_hf = _compile({hf: ours for ours, hf in self.NAMES.items()})

    def described(self, config: dict[str, Any]) -> dict[str, Any]:
        """The values of a config.json that decide the model's function (its `model_type`
        among them), transformers' defaults filled in: what check_hf_config compares."""
        raise NotImplementedError

    def hf_name(self, key: str) -> str:
        """Our key -> its HF name (KeyError for a key the table has no pattern for)."""
        return _rename(key, self._to_hf)

    def our_name(self, name: str) -> str:
        """An HF name -> our key (KeyError for a name the table has no pattern for)."""
        return _rename(name, self._from_hf)

    def tied_to(self, key: str, args: DecoderArgs) -> str | None:
        """A tied model's head is its embedding table: HF stores it once, as `embed_tokens`."""
        return self.EMBEDDING if key == self.HEAD and args.tie_word_embeddings else None

    def stacked_hf_names(self, key: str, args: DecoderArgs) -> list[str] | None:
        return None

    def stacked_key(self, name: str) -> tuple[str, int] | None:
        """An HF name of one slice of a stacked tensor -> (our key, the slice), or None."""
        return None

    def zero_in_hf(self, key: str, args: DecoderArgs) -> bool:
        return False

    def zeros_hf_lacks(self, args: DecoderArgs) -> dict[str, torch.Tensor]:
        """Our state that `zero_in_hf` names, as the zeros it is in HF's model."""
        return {}

    def rotary_heads(self, key: str, args: DecoderArgs) -> int | None:
        return None

    def ignored_hf_tensor(self, name: str, args: DecoderArgs) -> bool:
        """A tied model's duplicate head."""
        return name == "lm_head.weight" and args.tie_word_embeddings

    def copies(self, key: str, args: DecoderArgs) -> list[str]:
        return []

    def hf_export_problems(self, args: DecoderArgs) -> list[str]:
        return []

    @staticmethod
    def interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
        """Rows of a q/k projection, Meta's interleaved pairs -> HF's rotate-half order."""
        rows, cols = weight.shape
        return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    @staticmethod
    def half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
        """The inverse of `interleaved_to_half`."""
        rows, cols = weight.shape
        return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)

    def to_hf(self, state_dict: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        """Our full state dict -> HF names and layout: a stacked tensor one view per slice, rotary
        rows permuted (new tensors), the tied head and state HF lacks left out."""
        out = {}
        for key, value in state_dict.items():
            if self.tied_to(key, args) or self.zero_in_hf(key, args):
                continue
            if names := self.stacked_hf_names(key, args):
                out.update(zip(names, value.unbind(0)))
            elif heads := self.rotary_heads(key, args):
                out[self.hf_name(key)] = self.interleaved_to_half(value, heads)
            else:
                out[self.hf_name(key)] = value
            out.update(dict.fromkeys(self.copies(key, args), value))
        return out

    def from_hf(self, state_dict: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        """HF names and layout -> our full state dict: slices stacked, rotary rows permuted back,
        state HF lacks as its zeros, a tied head as the embedding table; a name neither mapped
        nor ignored is a KeyError."""
        out, slices = {}, {}
        for name, value in state_dict.items():
            if self.ignored_hf_tensor(name, args):
                continue
            if stacked := self.stacked_key(name):
                slices.setdefault(stacked[0], {})[stacked[1]] = value
                continue
            key = self.our_name(name)
            heads = self.rotary_heads(key, args)
            out[key] = self.half_to_interleaved(value, heads).contiguous() if heads else value
        for key, parts in slices.items():
            out[key] = torch.stack([parts[e] for e in range(args.moe.n_experts)])
        out.update(self.zeros_hf_lacks(args))
        if args.tie_word_embeddings:
            out[self.HEAD] = out[self.EMBEDDING]
        return out

    def check_hf_config(self, config: dict[str, Any], args: DecoderArgs) -> list[str]:
        """How a Hugging Face config.json differs from these hyperparameters, one phrase per key
        `described` reads (the model type first, alone). Empty: it describes this model."""
        expected = self.described(self.hf_config(args))
        if config.get("model_type", self.MISSING_MODEL_TYPE) != expected["model_type"]:
            return [f"model_type {config.get('model_type')!r} (this model: {expected['model_type']!r})"]
        try:
            got = self.described(config)
        except (KeyError, ValueError, TypeError) as error:
            return [f"unreadable {self.UNREADABLE} ({error})"]
        expected = self.compared(expected, got, args)
        return [f"{key} {got[key]} (this model: {expected[key]})" for key in expected if got[key] != expected[key]]

    def compared(self, expected: dict[str, Any], got: dict[str, Any], args: DecoderArgs) -> dict[str, Any]:
        """The expected values check_hf_config compares (a family leaves out what says nothing)."""
        return expected

    @staticmethod
    def decoder_values(config: dict[str, Any], described: dict[str, Any], max_seq_len: int) -> dict[str, Any]:
        """The shared decoder's args from a GQA config.json and its `decoder_described` values
        (`max_seq_len` the family's context when the config has none); KeyError for a missing shape."""
        return dict(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=described["num_key_value_heads"],
            norm_eps=described["rms_norm_eps"],
            rope_theta=described["rope_theta"],
            max_seq_len=config.get("max_position_embeddings", max_seq_len),
            tie_word_embeddings=described["tie_word_embeddings"],
        )


# A stacked expert weight of ours is one HF tensor per expert: w1 [E, hidden, dim] <-> expert e's gate_proj (SWIGLU).
ROUTER_NAMES = {"layers.{i}.feed_forward.router.gate.weight": "model.layers.{i}.mlp.gate.weight"}
_STACKED = re.compile(r"^layers\.(\d+)\.(\w+)\.experts\.(w[123])$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")


class MoEHFAdapterBase(HFAdapterBase):
    """A family with models/moe.py's layer: its experts stacked here, `experts.w1 [E, hidden, dim]`
    (w2, w3), one tensor per expert in HF's files, `model.layers.L.mlp.experts.E.gate_proj.weight`
    (up_proj for w3, down_proj for w2), the names transformers 5 writes with `save_pretrained` and
    the published checkpoints hold. checkpoint/hf_plan.py maps a rank's shard of a stacked tensor
    to the per-expert tensors it covers, on load and on save."""

    EXPERT_BIAS_IN_HF: ClassVar[bool]  # False: HF's router has no expert bias, which acts as a zero one
    FEED_FORWARD: ClassVar[str] = "feed_forward"  # our name of a block's MoE layer

    def stacked_hf_names(self, key: str, args: DecoderArgs) -> list[str] | None:
        """`layers.L.feed_forward.experts.w1` -> `model.layers.L.mlp.experts.{0..E-1}.gate_proj.weight`."""
        if (match := _STACKED.match(key)) is None or match[2] != self.FEED_FORWARD:
            return None
        layer, _, weight = match.groups()
        return [f"model.layers.{layer}.mlp.experts.{e}.{SWIGLU[weight]}.weight" for e in range(args.moe.n_experts)]

    def stacked_key(self, name: str) -> tuple[str, int] | None:
        if (match := _EXPERT.match(name)) is None:
            return None
        layer, e, kind = match.groups()
        weight = next(w for w, k in SWIGLU.items() if k == kind)
        return f"layers.{layer}.{self.FEED_FORWARD}.experts.{weight}", int(e)

    def zero_in_hf(self, key: str, args: DecoderArgs) -> bool:
        return not self.EXPERT_BIAS_IN_HF and key.endswith("feed_forward.expert_bias")

    def zeros_hf_lacks(self, args: DecoderArgs) -> dict[str, torch.Tensor]:
        """An expert bias (in MoE flavors that have one) where HF's router has none."""
        if self.EXPERT_BIAS_IN_HF or args.moe is None or not args.moe.use_expert_bias:
            return {}
        layers = [i for i in range(args.n_layers) if args.moe_layer(i)]
        return {f"layers.{i}.feed_forward.expert_bias": torch.zeros(args.moe.n_experts) for i in layers}

    def compared(self, expected: dict[str, Any], got: dict[str, Any], args: DecoderArgs) -> dict[str, Any]:
        """The dense width is not compared when no block is dense (Qwen3-MoE configs carry one no block uses)."""
        if args.moe is not None and args.n_moe_layers == args.n_layers + args.mtp_depths:
            del expected["intermediate_size"]
        return expected


def decoder_described(config: dict[str, Any], rope: dict[str, Any], model_type: str | None = None) -> dict[str, Any]:
    """The values of a GQA decoder's config.json that decide its function, transformers' defaults
    filled in, with `rope` (what the family reads of RoPE) after the norm eps; `model_type` that
    of a config without one."""
    heads, dim = config.get("num_attention_heads"), config.get("hidden_size")
    return {
        "model_type": config.get("model_type", model_type),
        "hidden_size": dim,
        "intermediate_size": config.get("intermediate_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or (dim // heads if dim and heads else None),
        "vocab_size": config.get("vocab_size"),
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        **rope,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": bool(config.get("attention_bias", False)),
    }


def decoder_hf_config(args: DecoderModelArgs, dtype: torch.dtype, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json keys every decoder family writes alike (a family adds and overrides its
    own): shapes, norm eps, RoPE theta at the top level, bias-free SwiGLU attention and MLPs."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
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
        "tie_word_embeddings": args.tie_word_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": dtype_name(dtype),
    }
