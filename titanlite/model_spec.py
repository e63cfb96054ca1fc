"""What the trainer needs to know about a model, so nothing outside `models/` names one.

`ModelSpec` is the typed model contract: what every model provides (its class, flavors, TP
plan, FLOPs) and, in `Capabilities`, what each model declares it supports beyond that.
`DecoderArgs` is what the rest of titanlite reads of a flavor's hyperparameters (the planner,
the TP checks, MFU), typed, with the dense GQA decoder's answers as defaults. A run
that needs a capability its model does not declare is refused when it is planned
(`build.plan_run`, one line naming the option), before a device is touched, instead of failing
inside the model's first forward. docs/adding_a_model.md explains each capability at length.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.errors import TitanliteError

Capability = Literal["pipeline_split", "context_parallel", "document_mask", "kv_cache", "moe", "hf_adapter"]

# Each capability: what a run without it is refused for lacking, and what it needs from the
# model's code (the refusal line says both; docs/adding_a_model.md at length).
NEEDS: dict[Capability, tuple[str, str]] = {
    "pipeline_split": (
        "pipeline split",
        "a stage runs the model's own forward, which must skip the top-level modules the stage holds as None",
    ),
    "context_parallel": (
        "context-parallel attention",
        "an enable_context_parallel method, after which attention takes every cp rank's keys and values",
    ),
    "document_mask": ("document masking", "forward(tokens, document_ids) and an attn_mask_type field in its args"),
    "kv_cache": ("KV cache", "an enable_kv_cache(KVCache | None) method"),
    "moe": ("mixture-of-experts layers", "routed experts (models/moe.py's MoE) in its blocks"),
    "hf_adapter": ("Hugging Face mapping", "an HFAdapter as ModelSpec.hf_adapter"),
}


class MoEShape(Protocol):
    """What the planner reads of a flavor's mixture-of-experts layer (models/moe.py's MoEArgs)."""

    n_experts: int  # routed experts
    top_k: int  # routed experts per token
    hidden_dim: int  # each routed expert's SwiGLU width
    n_shared_experts: int  # experts every token runs


class AttentionWidths(NamedTuple):
    """One block's attention per token, summed over all heads before tp splits them: `q` and `k`
    the rotated queries and keys, `v` the values, `out` the output projection's input (n_heads x
    the value head dim); `latent`: activations every tp rank keeps whole (MLA's compressed
    latents), 0 for GQA. The planner counts what autograd keeps from these (parallel/estimate.py)."""

    q: int
    k: int
    v: int
    out: int
    latent: int = 0


@runtime_checkable
class DecoderArgs(Protocol):
    """A flavor's hyperparameters as titanlite reads them outside its model: a frozen dataclass
    that subclasses this Protocol to take the defaults below (a dense decoder with grouped-query
    attention over `kv_heads` heads of `head_dim`), overriding what differs. A family with its own
    attention says its widths in `attention_widths` (DeepSeek-V3's MLA: q and k n_heads x
    (qk_nope + qk_rope), v and out n_heads x v_head_dim, its latents); one with MoE blocks has an
    `moe` field and `moe_layer`. Every registered flavor is checked against it (`ModelSpec`)."""

    vocab_size: int  # replaced by the tokenizer's (`ModelSpec.args_for`)
    dim: int
    n_layers: int
    n_heads: int
    max_seq_len: int  # a longer training.seq_len is refused when planned
    attn_mask_type: str  # "causal" or "block_causal" (models/attention.py)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def tie_word_embeddings(self) -> bool:
        """One table for the embedding and the head (counted once in FLOPs and parameters)."""
        return False

    @property
    def ffn_hidden_dim(self) -> int:
        """The dense feed-forward's width."""
        return 4 * self.dim

    @property
    def qk_norm(self) -> bool:
        """q and k normalized per head (the planner counts the norms' inputs)."""
        return False

    @property
    def attention_widths(self) -> AttentionWidths:
        q, kv = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        return AttentionWidths(q=q, k=kv, v=kv, out=q)

    @property
    def moe(self) -> MoEShape | None:
        """The MoE layer of the blocks `moe_layer` picks; None: every block dense."""
        return None

    def moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has the MoE feed-forward."""
        return False

    def sliding_window(self, layer_id: int) -> int | None:
        """The sliding window of block `layer_id`'s attention in tokens (gpt-oss's alternate
        layers); None: it attends to every earlier token its mask allows."""
        return None

    @property
    def n_moe_layers(self) -> int:
        """The MoE blocks the model builds, its MTP blocks' (`mtp_depths`) among them."""
        return sum(self.moe_layer(i) for i in range(self.n_layers + self.mtp_depths))

    @property
    def mtp_depths(self) -> int:
        """Multi-token prediction modules after the blocks (DeepSeek-V3's MTP): module k also
        predicts the token k + 1 places ahead of the next one; 0: none."""
        return 0


DECODER_ARGS_MEMBERS = sorted({*DecoderArgs.__annotations__, *(n for n in vars(DecoderArgs) if not n.startswith("_"))})


HF_CONFIG_FILE = "config.json"


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """A Hugging Face folder's config.json, or one line saying why it cannot be read."""
    path = Path(folder) / HF_CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TitanliteError(f"{path}: missing (a Hugging Face model folder needs its config.json)") from None
    except ValueError as error:
        raise TitanliteError(f"{path}: not valid JSON ({error})") from None


class HFAdapter(Protocol):
    """A model's Hugging Face mapping (`ModelSpec.hf_adapter`): names, layouts and config.json,
    whole and per key. The per-key members let checkpoint/hf_io.py read and write a rank's shard
    without a full state dict. models/hf_names.py's `HFAdapterBase` (and `MoEHFAdapterBase` for
    stacked experts) implements everything but the config from a table of names."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]]  # the config.json `model_type`s it reads

    def to_hf(self, state_dict: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        """Our full state dict -> HF names and layout."""

    def from_hf(self, state_dict: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        """HF names and layout -> our full state dict."""

    def hf_config(self, args: DecoderArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for these hyperparameters."""

    def check_hf_config(self, config: dict[str, Any], args: DecoderArgs) -> list[str]:
        """How config.json differs from these hyperparameters, one phrase per key; empty: it matches."""

    def args_from_hf_config(self, config: dict[str, Any], base: DecoderArgs | None = None) -> DecoderArgs:
        """The model's args from config.json (`base`'s training settings kept when given)."""

    def hf_export_problems(self, args: DecoderArgs) -> list[str]:
        """What of this flavor HF's class cannot hold (a run that would write it is refused when planned)."""

    def hf_name(self, key: str) -> str:
        """Our key of a tensor HF stores whole -> its HF name."""

    def tied_to(self, key: str, args: DecoderArgs) -> str | None:
        """The key whose tensor this one is (HF stores it once), or None."""

    def stacked_hf_names(self, key: str, args: DecoderArgs) -> list[str] | None:
        """For a tensor held as [E, ...] that HF stores one slice per name: those names."""

    def zero_in_hf(self, key: str, args: DecoderArgs) -> bool:
        """State HF's class lacks, acting as zero there."""

    def rotary_heads(self, key: str, args: DecoderArgs) -> int | None:
        """The heads whose rows HF's RoPE layout permutes (`interleaved_to_half`), or None."""

    def ignored_hf_tensor(self, name: str, args: DecoderArgs) -> bool:
        """A tensor HF files may hold that is no weight of this model."""

    def copies(self, key: str, args: DecoderArgs) -> list[str]:
        """HF names that hold our `key`'s tensor once more (written on save, ignored on load)."""

    def interleaved_to_half(self, weight: torch.Tensor, n_heads: int) -> torch.Tensor:
        """Rows of a q/k projection, interleaved RoPE pairs -> HF's rotate-half order."""


@dataclass(frozen=True)
class Capabilities:
    """What a model declares it supports beyond the base contract (see `NEEDS` for what each
    asks of its code). Everything defaults to False: a new model supports nothing extra until
    its author declares it, and tests/unit/test_model_spec.py then checks each declaration
    against the model's code, so a declaration cannot claim what the code does not do."""

    # Split into pipeline stages (parallelism.pipeline_parallel_degree > 1).
    pipeline_split: bool = False
    # Attention over a sequence split across cp ranks (parallelism.context_parallel_degree > 1).
    context_parallel: bool = False
    # Block-causal attention within each packed document (model.attn_mask_type = "block_causal").
    document_mask: bool = False
    # Incremental decoding in `titanlite.generate`; without it each token recomputes the sequence.
    kv_cache: bool = False
    # Mixture-of-experts layers (models/moe.py) in some of its flavors: declared per model,
    # what each flavor has is in its args (e.g. an `moe` field). Its flops_per_token counts the
    # active parameters (the experts a token is routed to); the trainer trains the layers'
    # aux loss, updates their expert biases and logs their load wherever the built model has them.
    moe: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry.

    Contract for `model_class(args)`: `args` is a frozen dataclass satisfying `DecoderArgs`
    (checked here for every flavor); the module keeps its repeated blocks in `model.layers` (a ModuleDict), has
    `init_weights(seed)` that fills parameters identically for any parallel layout, and maps
    token ids [batch, seq] to logits [batch, seq, vocab]. `capabilities` says what else it
    supports (pipeline stages, context parallelism, document masks, a KV cache, MoE).
    """

    name: str
    model_class: Callable[[DecoderArgs], nn.Module]
    flavors: Mapping[str, DecoderArgs]
    # (model, tp_mesh, loss_parallel, sequence_parallel) -> None: parallelize_module the model in place.
    apply_tp: Callable[[nn.Module, DeviceMesh, bool, bool], None]
    # (args, tp_degree) -> one message per size that does not split tp_degree ways.
    tp_problems: Callable[[DecoderArgs, int], list[str]]
    # (args, n_params, seq_len) -> training FLOPs per token (forward + backward).
    flops_per_token: Callable[[DecoderArgs, int, int], float]
    # Optional Hugging Face conversion, whole and per key (checkpoint/hf_io.py).
    hf_adapter: HFAdapter | None = None
    capabilities: Capabilities = Capabilities()
    # Patterns (config/param_groups.py's) of the parameters that train without weight decay in the
    # default optimizer.param_groups, whose "@no_decay" stands for them: embeddings, norms, biases.
    no_decay: tuple[str, ...] = ()
    # A model without flavors takes its args from the folder `model.hf_assets_path` names:
    # folder -> args (models/hf: any transformers causal LM, from its config.json).
    folder_args: Callable[[str], DecoderArgs] | None = None

    def __post_init__(self) -> None:
        for flavor, args in self.flavors.items():
            if not isinstance(args, DecoderArgs):
                missing = [name for name in DECODER_ARGS_MEMBERS if not hasattr(args, name)]
                raise TypeError(f"model {self.name} flavor {flavor}: its args lack DecoderArgs' {', '.join(missing)}")

    def args_for(self, flavor: str, vocab_size: int) -> DecoderArgs:
        return dataclasses.replace(self.flavors[flavor], vocab_size=vocab_size)

    def supports(self, capability: Capability) -> bool:
        """Whether the model declares `capability` (an HF mapping: whether it has an adapter)."""
        return self.hf_adapter is not None if capability == "hf_adapter" else getattr(self.capabilities, capability)

    def lacks(self, capability: Capability) -> str:
        """The end of a refusal line: what the model has not, and what it would need."""
        what, needs = NEEDS[capability]
        declared = "" if capability == "hf_adapter" else f"; ModelSpec.capabilities.{capability}"
        return f"model {self.name} has no {what} ({needs}{declared})"


def transformer_flops_per_token(n_dense_params: int, n_layers: int, attn_width: int, seq_len: int) -> float:
    """6 FLOPs per weight per token (forward 2, backward 4) on every weight that does a
    matmul (the embedding lookup does not), plus causal-attention score and value matmuls:
    12 * layers * width * seq_len (PaLM's accounting, as torchtitan and Megatron report MFU)."""
    return 6 * n_dense_params + 12 * n_layers * attn_width * seq_len


def active_parameters(args: DecoderArgs, n_params: int) -> int:
    """The parameters one token's forward multiplies by: all of them but the embedding table
    (a lookup; a tied table is counted once, as the head) and, in each MoE block, the routed
    experts it is not sent to (n_experts - top_k of them, each three dim x hidden matrices)."""
    embedding = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    idle = 0
    if args.moe is not None:
        idle = args.n_moe_layers * (args.moe.n_experts - args.moe.top_k) * 3 * args.dim * args.moe.hidden_dim
    return n_params - embedding - idle


def decoder_flops_per_token(args: DecoderArgs, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token of a GQA decoder (Llama's, Qwen3's) from its active parameters."""
    active = active_parameters(args, n_params)
    return transformer_flops_per_token(active, args.n_layers, args.n_heads * args.head_dim, seq_len)
