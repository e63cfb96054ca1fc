"""DeepSeek-V3 (models/deepseek_v3/): its multi-head latent attention against a plain reference
written here (keys and values materialized head by head from the latent, ordinary softmax
attention under an explicit mask) in float64, both query paths, causal and block-causal;
chunked (context-parallel) attention with a value head dim unlike the key's; KV-cache decoding
against a full forward, of the attention and of the whole model; the model's blocks, parameter
names and shapes (the Hugging Face adapter's contract), its FLOPs per token, its TP checks, and
the refusal of torchtitan's multi-token prediction key (the depth is the flavor's: test_deepseek_v3_mtp.py).

RoPE rotates in float32 (models/rope.py's apply_rope, the decoder's for every family), so float64
results agree to about 1e-7 relative, not to float64's precision."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanlite.config import load_config
from titanlite.errors import TitanliteError
from titanlite.models.attention import attend, build_mask
from titanlite.models.chunked_attention import plan_chunks
from titanlite.models.deepseek_v3.attention import LATENT_NORM_EPS, MLA
from titanlite.models.decoder import FeedForward
from titanlite.models.deepseek_v3 import deepseek_v3_flavors, deepseek_v3_spec
from titanlite.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args
from titanlite.models.moe import MoE, MoEArgs
from titanlite.models.kv_cache import KVCache, LayerKVCache
from titanlite.models.rope import YaRN, yarn_get_mscale
from titanlite.parallel.context_parallel import chunk_positions, chunk_starts

SEQ = 12
# Small MLA shapes whose widths all differ, so a split or a head layout that is off shows.
ARGS = DeepSeekV3Args(
    dim=32,
    n_layers=1,
    n_heads=4,
    vocab_size=64,
    q_lora_rank=0,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    hidden_dim=48,
    rope_scaling=YaRN(factor=4.0, original_max_position_embeddings=8, mscale=0.8, mscale_all_dim=0.8),
    max_seq_len=32,
)
DOCS = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 9 + [1] * 3])


def rope_angles(args: DeepSeekV3Args, seq: int) -> torch.Tensor:
    """[seq, qk_rope_head_dim / 2] rotation angles (any frequencies do: the table is the decoder's)."""
    exponents = torch.arange(0, args.qk_rope_head_dim, 2, dtype=torch.float64) / args.qk_rope_head_dim
    freqs = 1.0 / args.rope_theta**exponents
    return torch.outer(torch.arange(seq, dtype=torch.float64), freqs)


def filled(args: DeepSeekV3Args) -> MLA:
    """An MLA in float64 with random weights, norms included (not all ones)."""
    torch.manual_seed(0)
    attention = MLA(args).double()
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(torch.randn_like(param) * (0.3 if param.dim() == 2 else 1.0))
    return attention


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1) of x [seq, width] rotated by angles [seq, width / 2]."""
    x0, x1 = x[:, 0::2], x[:, 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + LATENT_NORM_EPS) * weight


def reference(attention: MLA, args: DeepSeekV3Args, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """MLA written out for each sequence and head: x [batch, seq, dim], allowed [batch, seq, seq]."""
    nope, v_dim = args.qk_nope_head_dim, args.v_head_dim
    angles = rope_angles(args, x.shape[1])
    outputs = []
    for b in range(x.shape[0]):
        h = x[b]
        if args.q_lora_rank == 0:
            q = h @ attention.wq.weight.T
        else:
            q = rms_norm(h @ attention.wq_a.weight.T, attention.q_norm.weight) @ attention.wq_b.weight.T
        kv_a = h @ attention.wkv_a.weight.T
        latent = rms_norm(kv_a[:, : args.kv_lora_rank], attention.kv_norm.weight)
        k_pe = rotate(kv_a[:, args.kv_lora_rank :], angles)  # one rotary key for every head
        heads = []
        for head in range(args.n_heads):
            q_h = q[:, head * args.qk_head_dim : (head + 1) * args.qk_head_dim]
            q_h = torch.cat([q_h[:, :nope], rotate(q_h[:, nope:], angles)], dim=-1)
            rows = attention.wkv_b.weight[head * (nope + v_dim) : (head + 1) * (nope + v_dim)]
            k_h = torch.cat([latent @ rows[:nope].T, k_pe], dim=-1)
            v_h = latent @ rows[nope:].T
            scores = (q_h @ k_h.T) * args.qk_head_dim**-0.5 * yarn_get_mscale(4.0, 0.8) ** 2
            scores = scores.masked_fill(~allowed[b], float("-inf"))
            heads.append(scores.softmax(dim=-1) @ v_h)
        outputs.append(torch.cat(heads, dim=-1) @ attention.wo.weight.T)
    return torch.stack(outputs)


def allowed_pairs(mask_type: str, seq: int) -> torch.Tensor:
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().expand(2, seq, seq)
    if mask_type == "causal":
        return causal
    return causal & (DOCS[:, :, None] == DOCS[:, None, :])


@pytest.mark.parametrize("q_lora_rank", [0, 7])
@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_mla_equals_a_plain_per_head_reference(q_lora_rank, mask_type):
    args = dataclasses.replace(ARGS, q_lora_rank=q_lora_rank)
    attention = filled(args)
    x = torch.randn(2, SEQ, args.dim, dtype=torch.float64)
    angles = rope_angles(args, SEQ)
    cos_sin = torch.polar(torch.ones_like(angles), angles)
    mask = build_mask(mask_type, DOCS if mask_type == "block_causal" else None, None, None, flex=False)
    out = attention(x, cos_sin, mask)
    torch.testing.assert_close(out, reference(attention, args, x, allowed_pairs(mask_type, SEQ)), rtol=1e-6, atol=1e-6)
    assert set(dict(attention.named_parameters())) == (
        {"wq.weight"} if q_lora_rank == 0 else {"wq_a.weight", "q_norm.weight", "wq_b.weight"}
    ) | {"wkv_a.weight", "kv_norm.weight", "wkv_b.weight", "wo.weight"}


def test_softmax_scale_is_yarns_mscale_squared_only_with_mscale_all_dim():
    plain = dataclasses.replace(ARGS, rope_scaling=None)
    assert plain.softmax_scale == plain.qk_head_dim**-0.5
    without = dataclasses.replace(
        ARGS, rope_scaling=YaRN(factor=4.0, original_max_position_embeddings=8, mscale=0.8, mscale_all_dim=0.0)
    )
    assert without.softmax_scale == plain.softmax_scale
    assert ARGS.softmax_scale == pytest.approx(14**-0.5 * (0.1 * 0.8 * torch.tensor(4.0).log().item() + 1) ** 2)


@pytest.mark.parametrize("v_head_dim", [6, 20])  # narrower and wider than the keys' 14
@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_chunked_attention_takes_a_value_head_dim_unlike_the_keys(v_head_dim, mask_type):
    """Context parallelism's per-chunk attention (cp 2, each rank's two chunks) with values of
    another head dim and MLA's softmax scale: outputs and gradients as dense SDPA's."""
    torch.manual_seed(1)
    seq, scale = 16, 0.37
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 13]) if mask_type == "block_causal" else None
    q = torch.randn(2, 3, seq, 14, requires_grad=True)
    k = torch.randn(2, 3, seq, 14, requires_grad=True)
    v = torch.randn(2, 3, seq, v_head_dim, requires_grad=True)
    weights = torch.randn(2, 3, seq, v_head_dim)
    positions = torch.arange(seq)
    dense = attend(q, k, v, build_mask(mask_type, docs, positions, positions, flex=False), False, scale)
    (dense * weights).sum().backward()
    expected = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    for rank in range(2):
        rows = chunk_positions(seq, rank, 2)
        plan = plan_chunks(mask_type, docs, chunk_starts(seq, rank, 2), seq // 4, torch.float32)
        out = attend(q[:, :, rows], k, v, plan, False, scale)
        torch.testing.assert_close(out, dense[:, :, rows].detach(), rtol=1e-5, atol=1e-5)
        (out * weights[:, :, rows]).sum().backward()
    for grad, want in zip((q.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [0, 7])
def test_kv_cache_decoding_equals_the_full_forward(q_lora_rank):
    """A 5-token prompt, then one token at a time: every output as the whole sequence's
    forward gives it (the cache keeps keys of qk_head_dim and values of v_head_dim)."""
    args = dataclasses.replace(ARGS, q_lora_rank=q_lora_rank)
    attention = filled(args)
    x = torch.randn(2, SEQ, args.dim, dtype=torch.float64)
    angles = rope_angles(args, SEQ)
    table = torch.polar(torch.ones_like(angles), angles)
    full = attention(x, table, None)
    cache = KVCache(max_len=SEQ)
    attention.kv_cache = LayerKVCache(cache)
    outputs, start = [], 0
    for length in (5, *[1] * (SEQ - 5)):
        positions = cache.positions(length, x.device)
        outputs.append(attention(x[:, start : start + length], table[positions], cache.mask(length, x.device)))
        cache.advance(length)
        start += length
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, rtol=1e-6, atol=1e-6)
    assert attention.kv_cache.keys.shape[-1] == args.qk_head_dim and attention.kv_cache.values.shape[-1] == 10


# A whole model at MLA's small shapes: 3 blocks, the first dense, then MoE blocks with
# group-limited sigmoid routing and a shared expert.
MODEL_ARGS = dataclasses.replace(
    ARGS,
    n_layers=3,
    q_lora_rank=7,
    moe=MoEArgs(
        n_experts=4,
        top_k=2,
        hidden_dim=16,
        n_shared_experts=1,
        score_func="sigmoid",
        renormalize=True,
        route_scale=2.5,
        use_expert_bias=True,
        n_group=2,
        topk_group=1,
    ),
)


def test_dense_blocks_then_moe_blocks_with_hugging_faces_names_and_shapes():
    """What hf_adapter.py maps: block i dense below n_dense_layers, MoE above; every name and
    shape of the contract, for both query paths."""
    for q_lora_rank in (0, 7):
        args = dataclasses.replace(MODEL_ARGS, q_lora_rank=q_lora_rank, n_dense_layers=1)
        with torch.device("meta"):
            model = DeepSeekV3(args)
        assert [type(block.feed_forward) for block in model.layers.values()] == [FeedForward, MoE, MoE]
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        heads, qk, nope, v = args.n_heads, args.qk_head_dim, args.qk_nope_head_dim, args.v_head_dim
        query = (
            {"wq.weight": (heads * qk, args.dim)}
            if q_lora_rank == 0
            else {
                "wq_a.weight": (q_lora_rank, args.dim),
                "q_norm.weight": (q_lora_rank,),
                "wq_b.weight": (heads * qk, q_lora_rank),
            }
        )
        attention = {
            **query,
            "wkv_a.weight": (args.kv_lora_rank + args.qk_rope_head_dim, args.dim),
            "kv_norm.weight": (args.kv_lora_rank,),
            "wkv_b.weight": (heads * (nope + v), args.kv_lora_rank),
            "wo.weight": (args.dim, heads * v),
        }
        moe, width = args.moe, args.moe.n_shared_experts * args.moe.hidden_dim
        for i in range(args.n_layers):
            expected = {f"attention.{name}": shape for name, shape in attention.items()}
            expected |= {"attention_norm.weight": (args.dim,), "ffn_norm.weight": (args.dim,)}
            if i < args.n_dense_layers:
                hidden = args.hidden_dim
                expected |= {
                    "feed_forward.w1.weight": (hidden, args.dim),
                    "feed_forward.w2.weight": (args.dim, hidden),
                    "feed_forward.w3.weight": (hidden, args.dim),
                }
            else:
                expected |= {
                    "feed_forward.router.gate.weight": (moe.n_experts, args.dim),
                    "feed_forward.experts.w1": (moe.n_experts, moe.hidden_dim, args.dim),
                    "feed_forward.experts.w2": (moe.n_experts, args.dim, moe.hidden_dim),
                    "feed_forward.experts.w3": (moe.n_experts, moe.hidden_dim, args.dim),
                    "feed_forward.shared_experts.w1.weight": (width, args.dim),
                    "feed_forward.shared_experts.w2.weight": (args.dim, width),
                    "feed_forward.shared_experts.w3.weight": (width, args.dim),
                    "feed_forward.expert_bias": (moe.n_experts,),
                }
            assert {k[len(f"layers.{i}.") :]: s for k, s in shapes.items() if k.startswith(f"layers.{i}.")} == expected
        assert {k: s for k, s in shapes.items() if not k.startswith("layers.")} == {
            "tok_embeddings.weight": (args.vocab_size, args.dim),
            "norm.weight": (args.dim,),
            "output.weight": (args.vocab_size, args.dim),
        }
        assert model.rope_cache.shape == (args.max_seq_len, args.qk_rope_head_dim // 2)


@pytest.mark.parametrize("mtp_depths", [0, 1])
def test_generation_with_the_kv_cache_equals_the_full_forward(mtp_depths):
    """The whole model (MLA, dense and MoE blocks, YaRN table) decoding token by token after a
    prompt gives the logits of one forward over the whole sequence; a multi-token prediction
    block (trained, not used to decode) changes nothing."""
    torch.manual_seed(0)
    model = DeepSeekV3(dataclasses.replace(MODEL_ARGS, num_nextn_predict_layers=mtp_depths))
    model.init_weights(seed=3)
    model.eval()
    tokens = torch.randint(0, MODEL_ARGS.vocab_size, (2, SEQ))
    with torch.no_grad():
        full = model(tokens)
        model.enable_kv_cache(KVCache(max_len=SEQ))
        steps = [model(tokens[:, :4])]
        model.kv_cache.advance(4)
        for i in range(4, SEQ):
            steps.append(model(tokens[:, i : i + 1]))
            model.kv_cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_flops_per_token_count_the_active_parameters_and_mlas_widths():
    """6 per weight a token multiplies by (the routed experts it is sent to, top_k of each
    MoE layer's; no embedding lookup) plus MLA's score (qk_head_dim) and value (v_head_dim)
    matmuls, each 6 * heads * width * seq per layer; counted here from the built model."""
    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=512)
    with torch.device("meta"):
        model = DeepSeekV3(args)
    n_params = sum(p.numel() for p in model.parameters())
    routed = [layer.experts for layer in model.modules() if isinstance(layer, MoE)]
    idle = sum(
        sum(p.numel() for p in experts.parameters()) * (1 - args.moe.top_k / args.moe.n_experts) for experts in routed
    )
    active = n_params - model.tok_embeddings.weight.numel() - idle
    attention = args.n_layers * 6 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * 256
    assert deepseek_v3_spec.flops_per_token(args, n_params, 256) == pytest.approx(6 * active + attention)


def test_tp_problems_name_each_size_that_does_not_split():
    assert (
        deepseek_v3_spec.tp_problems(dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=4000), 2) == []
    )
    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=4001)
    assert deepseek_v3_spec.tp_problems(args, 5) == [
        "n_heads 8 is not divisible by tensor_parallel_degree 5",
        "vocab_size 4001 is not divisible by tensor_parallel_degree 5",
        "ffn hidden size 768 is not divisible by tensor_parallel_degree 5",
        "shared experts' hidden size 256 is not divisible by tensor_parallel_degree 5",
    ]


def test_torchtitans_multi_token_prediction_key_is_refused_in_one_line():
    argv = ["--config", "debug_model", "--model.name", "deepseek_v3", "--model.num_nextn_predict_layers"]
    with pytest.raises(
        TitanliteError, match=r"^model.num_nextn_predict_layers: not supported \(DeepSeek-V3's multi-token prediction"
    ):
        load_config([*argv, "1"])
    assert load_config([*argv, "0"]).model.name == "deepseek_v3"
