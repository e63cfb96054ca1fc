"""Qwen3 (dense) and Qwen3-MoE: the model, its flavors and its tensor-parallel plan, as one
registry entry.

The published sizes are the Hugging Face config.json files of Qwen/Qwen3-0.6B, -1.7B, -4B,
-8B, -14B, -32B, -30B-A3B and -235B-A22B (the first releases, 2025-04, not the -2507
updates, which raise rope_theta and max_position_embeddings): hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim 128, intermediate_size, rope_theta 1e6,
rms_norm_eps 1e-6, max_position_embeddings 40960, tie_word_embeddings (true up to 4B), and for
the MoE sizes num_experts 128, num_experts_per_tok 8, moe_intermediate_size, norm_topk_prob
true, router_aux_loss_coef 0.001, decoder_sparse_step 1, mlp_only_layers []. vocab_size
(151936 with Qwen's tokenizer) comes from the tokenizer in use.
"""

import dataclasses
import functools

from titanlite.models.decoder import NO_DECAY
from titanlite.models.moe import MoEArgs
from titanlite.models.qwen3.hf_adapter import qwen3_hf
from titanlite.models.qwen3.model import Qwen3, Qwen3Args, qwen3_moe
from titanlite.models.qwen3.parallelize import apply_tp, tp_problems
from titanlite.model_spec import Capabilities, ModelSpec, decoder_flops_per_token


# CPU-sized: trains in seconds on 2 cores with the bundled 4k-vocab tokenizer. Llama's debugmodel
# widths, Qwen3's shape: q wider than dim (8 heads x 64 = 512 > 256), QK norms.
_debug = Qwen3Args(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768, max_seq_len=2048)

qwen3_flavors: dict[str, Qwen3Args] = {
    "debugmodel": _debug,
    # 8 experts, top-2. It also runs DeepSeek-V3's expert-bias balancing (with a faster bias
    # step), which no published Qwen3 has, so that the tests train every path of the MoE layer.
    "debugmodel_moe": dataclasses.replace(
        _debug, moe=qwen3_moe(8, 2, 256, use_expert_bias=True, bias_update_rate=1e-2)
    ),
    # The same layer balanced as Qwen3-MoE is, by the aux loss alone: the debug MoE flavor
    # Hugging Face's Qwen3MoeForCausalLM holds both ways (it has no expert bias).
    "debugmodel_moe_aux": dataclasses.replace(_debug, moe=qwen3_moe(8, 2, 256)),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_word_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_word_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_word_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
    # MoE: intermediate_size (6144, 12288) is in their config.json but no block uses it.
    "30B-A3B": Qwen3Args(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144, moe=qwen3_moe(128, 8, 768)),
    "235B-A22B": Qwen3Args(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288, moe=qwen3_moe(128, 8, 1536)
    ),
}


# torchtitan's Qwen3-MoE layer (n_experts, top_k, hidden_dim): softmax router, top-k renormalized
# (route_norm), no shared experts, balanced by the expert bias alone (load_balance_coeff 1e-3, its
# default): no aux loss.
_torchtitan_moe = functools.partial(
    MoEArgs, score_func="softmax", renormalize=True, use_expert_bias=True, bias_update_rate=1e-3
)


# torchtitan v0.2.2's qwen3 flavors (torchtitan/models/qwen3/__init__.py), which a torchtitan TOML file
# gets (config/torchtitan.py) as `torchtitan:<name>`. Its debug flavors are other shapes than ours (8
# layers, 16 heads of 128, 8 kv heads; 64 experts top-8), its MoE sizes balance by the expert bias
# instead of the aux loss, and its 235B-A22B has rope_theta 5e6; its dense sizes are the published
# ones, ours. max_seq_len: torchtitan's for the debug flavors, the published context for the others
# (torchtitan replaces it by training.seq_len when it builds the model).
_torchtitan_debug = Qwen3Args(
    dim=256,
    n_layers=8,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    hidden_dim=3072,
    max_seq_len=4096,
    tie_word_embeddings=True,
)
qwen3_torchtitan_flavors: dict[str, Qwen3Args] = {
    "debugmodel": _torchtitan_debug,
    **{name: qwen3_flavors[name] for name in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")},
    "debugmodel_moe": dataclasses.replace(
        _torchtitan_debug, tie_word_embeddings=False, moe=_torchtitan_moe(64, 8, 768)
    ),
    "30B-A3B": dataclasses.replace(qwen3_flavors["30B-A3B"], moe=_torchtitan_moe(128, 8, 768)),
    "235B-A22B": dataclasses.replace(qwen3_flavors["235B-A22B"], rope_theta=5e6, moe=_torchtitan_moe(128, 8, 1536)),
}


qwen3_spec = ModelSpec(
    name="qwen3",
    model_class=Qwen3,
    flavors={**qwen3_flavors, **{f"torchtitan:{name}": args for name, args in qwen3_torchtitan_flavors.items()}},
    apply_tp=apply_tp,
    tp_problems=tp_problems,
    # Qwen3ForCausalLM / Qwen3MoeForCausalLM, the experts one HF tensor each (hf_adapter.py).
    hf_adapter=qwen3_hf,
    # moe: the code has MoE blocks; which flavors use them is in their args (Qwen3Args.moe).
    no_decay=NO_DECAY,
    capabilities=Capabilities(pipeline_split=True, context_parallel=True, document_mask=True, kv_cache=True, moe=True),
    flops_per_token=decoder_flops_per_token,
)

__all__ = ["Qwen3", "Qwen3Args", "qwen3_flavors", "qwen3_hf", "qwen3_spec", "qwen3_torchtitan_flavors"]
