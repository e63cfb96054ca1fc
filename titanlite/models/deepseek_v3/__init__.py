"""DeepSeek-V3: the model, its flavors and its tensor-parallel plan, as one registry entry.

- `671B` is DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3): 61 layers, the
  first 3 dense, 256 routed experts top-8 in 8 groups of which 4 are kept, 1 shared expert,
  sigmoid scores renormalized and scaled by 2.5, the expert bias (e_score_correction_bias),
  q_lora_rank 1536, YaRN x40 from 4096 positions (mscale = mscale_all_dim = 1).
- `16B` is torchtitan's deepseek_v3 16B flavor (DeepSeek-V2-Lite's shape, DeepSeek-V3's
  balancing): 27 layers, 1 dense, 64 experts top-6 + 2 shared, softmax scores not
  renormalized, route scale 1, the expert bias, q_lora_rank 0, YaRN x40 from 4096 positions.
  Its mscale: torchtitan's 0.70 (DeepSeek-V2-Lite's config.json says 0.707), applied as
  transformers does (the softmax scale times mscale(40, 0.70)^2, whatever the sequence
  length; torchtitan applies it only to sequences longer than 4096).
- the debug flavors: CPU-sized (train in seconds on 2 cores with the bundled 4k-vocab
  tokenizer), every path of the model: MLA with a plain query projection (`debugmodel`) and
  the low-rank one (`debugmodel_q_lora`), YaRN, 1 dense block, group-limited routing (8
  experts in 2 groups, 1 kept, top-2), a shared expert, the expert bias (a faster step than
  the published 1e-3, so that tests see it move).

- `debugmodel_mtp`: the debug model with one multi-token prediction module
  (`num_nextn_predict_layers` 1, an MoE block as the published layer 61 is; model.py).
"""

import dataclasses
import functools

from titanlite.models.decoder import NO_DECAY
from titanlite.models.deepseek_v3.hf_adapter import deepseek_v3_hf
from titanlite.models.deepseek_v3.model_args import DeepSeekV3Args
from titanlite.models.deepseek_v3.model import DeepSeekV3
from titanlite.models.deepseek_v3.parallelize import apply_tp, tp_problems
from titanlite.models.moe import MoEArgs
from titanlite.models.rope import YaRN
from titanlite.model_spec import Capabilities, ModelSpec, active_parameters


# DeepSeek-V3's routing: sigmoid scores renormalized and scaled by 2.5, the expert bias, a shared expert.
_sigmoid_moe = functools.partial(
    MoEArgs, n_shared_experts=1, score_func="sigmoid", renormalize=True, route_scale=2.5, use_expert_bias=True
)
# The published MLA shape (16B and 671B): latents of 512, heads of 128 + 64 rotary, values of 128.
_published = functools.partial(
    DeepSeekV3Args, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0
)
_debug = DeepSeekV3Args(
    dim=256,
    n_layers=4,
    n_heads=8,
    q_lora_rank=0,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    hidden_dim=768,
    moe=_sigmoid_moe(n_experts=8, top_k=2, hidden_dim=256, bias_update_rate=1e-2, n_group=2, topk_group=1),
    n_dense_layers=1,
    rope_scaling=YaRN(factor=4.0, original_max_position_embeddings=512, mscale=1.0, mscale_all_dim=1.0),
    max_seq_len=2048,
)

deepseek_v3_flavors: dict[str, DeepSeekV3Args] = {
    "debugmodel": _debug,
    "debugmodel_q_lora": dataclasses.replace(_debug, q_lora_rank=96),
    "debugmodel_mtp": dataclasses.replace(_debug, num_nextn_predict_layers=1),
    "16B": _published(
        dim=2048,
        n_layers=27,
        n_heads=16,
        q_lora_rank=0,
        hidden_dim=10944,
        # MoEArgs' defaults: softmax scores, not renormalized, route scale 1, bias step 1e-3.
        moe=MoEArgs(n_experts=64, top_k=6, hidden_dim=1408, n_shared_experts=2, use_expert_bias=True),
        n_dense_layers=1,
        rope_scaling=YaRN(factor=40.0, original_max_position_embeddings=4096, mscale=0.70, mscale_all_dim=0.70),
        max_seq_len=4096 * 4,
    ),
    "671B": _published(
        dim=7168,
        n_layers=61,
        n_heads=128,
        q_lora_rank=1536,
        hidden_dim=18432,
        moe=_sigmoid_moe(n_experts=256, top_k=8, hidden_dim=2048, bias_update_rate=1e-3, n_group=8, topk_group=4),
        n_dense_layers=3,
        norm_eps=1e-6,
        rope_scaling=YaRN(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
        max_seq_len=163840,
    ),
}

# torchtitan v0.2.2's deepseek_v3 flavors (torchtitan/models/deepseek_v3/__init__.py), which a torchtitan TOML
# file gets (config/torchtitan.py) as `torchtitan:<name>`. Its debugmodel is another shape than ours: 6
# layers, 16 heads of the published MLA widths (kv_lora_rank 512), 8 experts top-3 of width 256 with 2
# shared, softmax scores, the expert bias. Its 16B and 671B are the published shapes, but with its norm eps
# 1e-5 (the published 1e-6) and plain RoPE: torchtitan sets max_seq_len to training.seq_len and scales by
# YaRN, mscale included, only above its original_seq_len 4096, so these are its models up to 4096 tokens
# (a longer seq_len is refused). vocab_size is the tokenizer's here, as for every flavor; its 16B and 671B
# attend within documents (flex, block_causal): here that is model.attn_mask_type's, as for Llama's files.
_torchtitan = functools.partial(dataclasses.replace, norm_eps=1e-5, rope_scaling=None, max_seq_len=4096)
_torchtitan_moe = dataclasses.replace(deepseek_v3_flavors["16B"].moe, n_experts=8, top_k=3, hidden_dim=256)
deepseek_v3_torchtitan_flavors: dict[str, DeepSeekV3Args] = {
    "debugmodel": _torchtitan(deepseek_v3_flavors["16B"], dim=256, n_layers=6, hidden_dim=1024, moe=_torchtitan_moe),
    **{name: _torchtitan(deepseek_v3_flavors[name]) for name in ("16B", "671B")},
}


def flops_per_token(args: DeepSeekV3Args, n_params: int, seq_len: int) -> float:
    """6 per active weight, plus MLA's score and value matmuls: 6 * layers * heads *
    (qk_head_dim + v_head_dim) * seq_len (forward and backward; PaLM's accounting, with the
    key width and the value width each counted for its own matmul, as torchtitan counts MLA),
    the multi-token prediction blocks' attention among the layers'."""
    attention = 6 * (args.n_layers + args.mtp_depths) * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return 6 * active_parameters(args, n_params) + attention


deepseek_v3_spec = ModelSpec(
    name="deepseek_v3",
    model_class=DeepSeekV3,
    flavors={**deepseek_v3_flavors, **{f"torchtitan:{name}": a for name, a in deepseek_v3_torchtitan_flavors.items()}},
    apply_tp=apply_tp,
    tp_problems=tp_problems,
    # DeepseekV3ForCausalLM, the experts one HF tensor each (hf_adapter.py).
    hf_adapter=deepseek_v3_hf,
    no_decay=NO_DECAY,
    capabilities=Capabilities(pipeline_split=True, context_parallel=True, document_mask=True, kv_cache=True, moe=True),
    flops_per_token=flops_per_token,
)

__all__ = ["DeepSeekV3", "DeepSeekV3Args", "deepseek_v3_flavors", "deepseek_v3_hf", "deepseek_v3_spec"]
