"""Any transformers causal LM as a titanlite model: the class transformers builds from the
folder's config.json (`AutoModelForCausalLM`), run by its own forward.

`HFCausalLM` adopts the children of the transformers model's decoder (`embed_tokens`,
`layers`, `norm`, `rotary_emb`) and its head (`lm_head`), so every state dict key is
transformers' own name without the decoder's `model.` prefix (hf_adapter.py adds it back);
the transformers model itself is kept unregistered and runs the forward, so whatever its class
does around the decoder (Gemma's embedding scale and logit soft-capping, Granite's
multipliers, sliding windows per layer) is kept. Its blocks are moved from a ModuleList into
`LayerDict`, the ModuleDict titanlite's contract asks for (`layers`), under the same names; the
sparse-MoE blocks titanlite's layer expresses are replaced by it (moe.py), and titanlite's
attention (attention.py) runs where its masks are needed.

Weights are initialized by the model's own `_init_weights` (transformers' init for its type:
normals of `initializer_range`, ones or zeros for norms, RoPE tables), with every random draw
replaced by models/init.py's counter-based values keyed by the parameter's name: the same
weights at any layout, each rank computing only its shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from titanlite.errors import TitanliteError
from titanlite.model_spec import DecoderArgs
from titanlite.models.attention import build_mask
from titanlite.models.chunked_attention import plan_chunks
from titanlite.models.hf.attention import register_attention
from titanlite.models.hf.moe import moe_args, sparse_blocks
from titanlite.models.init import ShardInit
from titanlite.models.moe import MoE, MoEArgs, moe_layers
from titanlite.parallel.context_parallel import ContextParallel


@dataclass(frozen=True)
class HFArgs(DecoderArgs):
    """What titanlite reads of a transformers config (its names in brackets); `folder` holds
    the config.json the model is built from."""

    folder: str
    model_type: str
    vocab_size: int  # [vocab_size]: the model's table; the tokenizer may use fewer ids
    dim: int  # [hidden_size]
    n_layers: int  # [num_hidden_layers]
    n_heads: int  # [num_attention_heads]
    n_kv_heads: int  # [num_key_value_heads]
    hidden_dim: int  # [intermediate_size]
    max_seq_len: int  # [max_position_embeddings]
    head_dim: int = 0  # [head_dim], or hidden_size / heads
    tie_word_embeddings: bool = False
    attn_mask_type: str = "causal"
    moe: MoEArgs | None = None  # titanlite's MoE layer in place of the sparse blocks (models/hf/moe.py)
    moe_layers: tuple[int, ...] = ()  # the blocks it replaces

    def moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layers

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    def config(self):
        """The folder's transformers config (the class its `model_type` names)."""
        return hf_config(self.folder)


def hf_config(folder: str):
    """`folder`'s config.json as its transformers config class; nothing is downloaded."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def read_hf_args(folder: str) -> HFArgs:
    """HFArgs from `folder`/config.json; one line naming the folder or key when it cannot be read."""
    path = Path(folder) / "config.json"
    if not folder or not path.is_file():
        raise TitanliteError(f"model.hf_assets_path: {folder or '(empty)'} holds no config.json")
    try:
        config = hf_config(folder)
    except (ValueError, KeyError, OSError) as error:
        raise TitanliteError(f"model.hf_assets_path: {path} is no transformers config ({error})") from None
    text = config.get_text_config()
    heads = text.num_attention_heads
    moe, sparse = moe_args(text), ()
    if moe is not None:  # which blocks are sparse: the type's own rule, read off the model built on meta
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            sparse = tuple(sparse_blocks(AutoModelForCausalLM.from_config(config).get_decoder()))
    return HFArgs(
        folder=str(folder),
        model_type=config.model_type,
        vocab_size=text.vocab_size,
        dim=text.hidden_size,
        n_layers=text.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        hidden_dim=getattr(text, "intermediate_size", 4 * text.hidden_size),
        max_seq_len=getattr(text, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        moe=moe,
        moe_layers=sparse,
    )


DECODER = "model"  # where a transformers causal LM keeps its decoder (`base_model_prefix`)


class LayerDict(nn.ModuleDict):
    """The blocks under their ModuleList names ("0", "1", ...), sliced as a list by the
    transformers forward (`self.layers[: n]`)."""

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, slice) else super().__getitem__(key)


class HFCausalLM(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab] of the folder's transformers model.

    Its children are the decoder's (`embed_tokens`, `layers`, `norm`, `rotary_emb`: the
    config's `base_model_pp_plan` names) and the head's, so the pipeline split
    (parallel/pipeline.py) cuts it as a native family. A stage runs the transformers forward
    over the blocks it holds: a later stage's first block takes the previous stage's hidden
    states in place of the embedding's, and a stage before the last ends at its last block.
    """

    def __init__(self, args: HFArgs):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.args = args
        config = args.config()
        config.use_cache = False
        attention = register_attention() if args.attn_mask_type == "block_causal" else "sdpa"
        hf = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        base = hf.get_decoder()
        if base is not getattr(hf, DECODER, None) or not isinstance(getattr(base, "layers", None), nn.ModuleList):
            raise TitanliteError(f"model.hf_assets_path: {args.model_type}'s decoder is not at .{DECODER}.layers")
        base.layers = LayerDict({str(i): block for i, block in enumerate(base.layers)})
        for i in args.moe_layers:
            base.layers[str(i)].mlp = MoE(args.dim, args.moe)
        for name, child in [*base.named_children(), *hf.named_children()]:
            if child is not base:
                self.add_module(name, child)
        object.__setattr__(self, "hf", hf)  # not a child: its modules are ours already
        self.layer_types = getattr(config, "layer_types", None)  # each block's attention, read by position
        self.context_parallel: ContextParallel | None = None

    def enable_context_parallel(self, context_parallel: ContextParallel) -> None:
        """Context parallelism: this rank's tokens at their global positions, attended to every
        cp rank's keys and values (models/hf/attention.py)."""
        self.context_parallel = context_parallel
        self.hf.set_attn_implementation(register_attention())

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (or, on a later pipeline stage, hidden states) -> logits (or hidden states);
        document_ids [batch, window] under block_causal attention (models/hf/attention.py)."""
        base = self.hf.get_decoder()
        base.norm = self.norm if self.norm is not None else nn.Identity()
        if self.layer_types is not None:  # the forward reads config.layer_types[i] for its i-th block
            base.config.layer_types = [self.layer_types[int(key)] for key in self.layers]
        inputs, hook = {"input_ids": x}, None
        if self.embed_tokens is None:  # a later stage: zeros for the embedding, x into its first block
            inputs = {"inputs_embeds": x.new_zeros(()).expand_as(x)}
            hook = next(iter(self.layers.values())).register_forward_pre_hook(_input_from(x), with_kwargs=True)
        dtype = x.dtype if x.is_floating_point() else self.embed_tokens.weight.dtype  # the masks' (the queries')
        mask_type, seq = self.args.attn_mask_type, x.shape[1]
        if (cp := self.context_parallel) is not None:  # this rank's two chunks of the window
            mask = plan_chunks(mask_type, document_ids, cp.chunk_starts(seq), seq // 2, dtype)
            inputs.update(position_ids=cp.positions(seq, x.device)[None], context_parallel=cp, titanlite_mask=mask)
        elif mask_type == "block_causal":
            inputs.update(titanlite_mask=build_mask(mask_type, document_ids, None, None, flex=x.is_cuda))
        try:
            if self.lm_head is None:
                return base(**inputs, use_cache=False).last_hidden_state
            return self.hf(**inputs, use_cache=False).logits
        finally:
            if hook is not None:
                hook.remove()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """transformers' init for this model type, its random draws layout-independent."""
        if self.args.tie_word_embeddings:
            self.hf.tie_weights()  # `to_empty` gave the head a Parameter of its own
        shard_init = ShardInit(self, seed)
        with _draws_from(shard_init):
            for module in self.modules():
                if module is not self:
                    self.hf._init_weights(module)
        for layer in moe_layers(self).values():  # titanlite's own init for the layers it swapped in
            layer.init_weights(shard_init, self.hf.config.initializer_range)


def _input_from(hidden: torch.Tensor):
    """A forward pre-hook giving a block `hidden` as its input (the first positional or
    `hidden_states`)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    return hook


@contextlib.contextmanager
def _draws_from(shard_init: ShardInit) -> Iterator[None]:
    """transformers' random initializers (`transformers.initialization`) drawing from `shard_init`."""
    from transformers import initialization

    def normal_(tensor, mean=0.0, std=1.0, generator=None):
        shard_init.normal(tensor, std)
        return tensor.add_(mean) if mean else tensor

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        shard_init.trunc_normal(tensor, std, a, b)
        return tensor.add_(mean) if mean else tensor

    saved = initialization.normal_, initialization.trunc_normal_
    initialization.normal_, initialization.trunc_normal_ = normal_, trunc_normal_
    try:
        yield
    finally:
        initialization.normal_, initialization.trunc_normal_ = saved
