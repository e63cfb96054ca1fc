"""gpt-oss: the model, its flavors and its tensor-parallel plan, as one registry entry.

`20B` and `120B` are the published config.json files of openai/gpt-oss-20b and -120b: 24 and
36 layers, 32 and 128 experts (top 4, each 2880 wide), hidden_size 2880, 64 heads of 64 with 8
kv heads, sliding_window 128 on alternate layers (sliding first), rope_theta 150000 with YaRN
x32 from 4096 positions (beta_fast 32, beta_slow 1, truncate false), max_position_embeddings
131072, rms_norm_eps 1e-5, swiglu_limit 7.0, vocab 201088 (with the o200k_harmony tokenizer;
here the tokenizer's). Their aux loss coefficient is a training setting: 1e-3 here
(the files say 0.9, which transformers does not apply unless output_router_logits).

The debug flavors are CPU-sized (the bundled 4k-vocab tokenizer, seconds a step on 2 cores):
4 blocks (sliding, full, sliding, full), 8 experts top 4, YaRN x4. `debugmodel`'s window (32
tokens) is shorter than the debug seq_len and longer than a context-parallel chunk of the
equivalence tests (64 tokens over cp 2: chunks of 16); `debugmodel_window8`'s is shorter.
"""

import dataclasses

from titanlite.models.decoder import NO_DECAY
from titanlite.models.gpt_oss.hf_adapter import gpt_oss_hf
from titanlite.models.gpt_oss.model import GptOss, GptOssArgs, gpt_oss_moe
from titanlite.models.gpt_oss.parallelize import apply_tp, tp_problems
from titanlite.models.rope import YaRN
from titanlite.model_spec import Capabilities, ModelSpec, decoder_flops_per_token

_debug = GptOssArgs(
    dim=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    head_dim=32,
    moe=gpt_oss_moe(8, 256),
    window=32,
    rope_scaling=YaRN(factor=4.0, original_max_position_embeddings=512, truncate=False),
    max_seq_len=2048,
)
_published = GptOssArgs(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, window=128, moe=gpt_oss_moe(32, 2880))

gpt_oss_flavors: dict[str, GptOssArgs] = {
    "debugmodel": _debug,
    "debugmodel_window8": dataclasses.replace(_debug, window=8),
    "20B": dataclasses.replace(_published, n_layers=24),
    "120B": dataclasses.replace(_published, n_layers=36, moe=gpt_oss_moe(128, 2880)),
}

gpt_oss_spec = ModelSpec(
    name="gpt_oss",
    model_class=GptOss,
    flavors=gpt_oss_flavors,
    apply_tp=apply_tp,
    tp_problems=tp_problems,
    # GptOssForCausalLM, the experts stacked as HF stores them (hf_adapter.py).
    hf_adapter=gpt_oss_hf,
    no_decay=(*NO_DECAY, "*.bias", "*.sinks"),
    capabilities=Capabilities(pipeline_split=True, context_parallel=True, document_mask=True, kv_cache=True, moe=True),
    flops_per_token=decoder_flops_per_token,
)

__all__ = ["GptOss", "GptOssArgs", "gpt_oss_flavors", "gpt_oss_hf", "gpt_oss_spec"]
