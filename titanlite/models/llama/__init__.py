"""Llama 2/3: the model, its flavors and its tensor-parallel plan, as one registry entry."""

import dataclasses
import functools

from titanlite.models import decoder_tp
from titanlite.models.decoder import NO_DECAY
from titanlite.models.llama.hf_adapter import llama3_hf
from titanlite.models.llama.model import Llama, LlamaArgs
from titanlite.models.llama.parallelize import tp_problems
from titanlite.model_spec import Capabilities, ModelSpec, decoder_flops_per_token

# Llama 3.1 long-context RoPE scaling: factor, low/high frequency factors, original context.
_LLAMA31_ROPE_SCALING = (8.0, 1.0, 4.0, 8192)
# Llama 3.2 (1B, 3B) scales by 32 from the same 8192 context.
_LLAMA32_ROPE_SCALING = (32.0, 1.0, 4.0, 8192)

# The published Llama 3.1 / 3.2 sizes share these (8 kv heads, rope_theta 5e5, 128k positions).
_published = functools.partial(LlamaArgs, n_kv_heads=8, rope_theta=500000.0, max_seq_len=131072)
_llama31 = functools.partial(_published, rope_scaling=_LLAMA31_ROPE_SCALING)
_llama32 = functools.partial(_published, rope_scaling=_LLAMA32_ROPE_SCALING, multiple_of=256, tie_word_embeddings=True)
# CPU-sized: trains on 2 cores in minutes with the bundled 4k-vocab tokenizer.
_debug = LlamaArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, rope_theta=500000.0, max_seq_len=2048)

llama3_flavors: dict[str, LlamaArgs] = {
    "debugmodel": _debug,
    # The same up to 8192 tokens: long sequences (context parallelism) in benches.
    "debugmodel_long": dataclasses.replace(_debug, max_seq_len=8192),
    # The same with one table for embedding and head, as Llama 3.2 has: tying on CPU layouts.
    "debugmodel_tied": dataclasses.replace(_debug, tie_word_embeddings=True),
    # The published Llama 3.2 hyperparameters (Meta's params.json; vocab 128256), for one GPU.
    "1B": _llama32(dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5),
    "3B": _llama32(dim=3072, n_layers=28, n_heads=24, ffn_dim_multiplier=1.0),
    # The published Llama 3.1 hyperparameters (vocab 128256 with Meta's tokenizer).
    "8B": _llama31(dim=4096, n_layers=32, n_heads=32, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": _llama31(dim=8192, n_layers=80, n_heads=64, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": _llama31(dim=16384, n_layers=126, n_heads=128, ffn_dim_multiplier=1.2, multiple_of=4096),
}

# torchtitan v0.2.2's llama3 flavors (torchtitan/models/llama3/__init__.py), which a torchtitan TOML
# file gets (config/torchtitan.py) as `torchtitan:<name>`. Its RoPE is always scaled as Llama 3.1's and
# its max_seq_len is 131072 unless set. Its debugmodel is another shape than ours: 16 heads of 16, no
# GQA; its 8B, 70B and 405B are the published ones, ours. Its *_flex_attn / *_varlen_attn variants
# are not here: titanlite picks the document mask by model.attn_mask_type.
llama3_torchtitan_flavors: dict[str, LlamaArgs] = {
    "debugmodel": LlamaArgs(
        dim=256, n_layers=6, n_heads=16, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE_SCALING, max_seq_len=131072
    ),
    **{name: llama3_flavors[name] for name in ("8B", "70B", "405B")},
}

llama3_spec = ModelSpec(
    name="llama3",
    model_class=Llama,
    flavors={**llama3_flavors, **{f"torchtitan:{name}": args for name, args in llama3_torchtitan_flavors.items()}},
    apply_tp=decoder_tp.apply_tp,
    tp_problems=tp_problems,
    hf_adapter=llama3_hf,
    no_decay=NO_DECAY,
    capabilities=Capabilities(pipeline_split=True, context_parallel=True, document_mask=True, kv_cache=True),
    flops_per_token=decoder_flops_per_token,
)

__all__ = ["Llama", "LlamaArgs", "llama3_flavors", "llama3_hf", "llama3_spec", "llama3_torchtitan_flavors"]
