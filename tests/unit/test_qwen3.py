"""Qwen3 and Qwen3-MoE (models/qwen3/): the logits of transformers' own Qwen3 and Qwen3-MoE
on the same weights, the per-head QK norm before RoPE, tied and untied flavors, the
published sizes, FLOPs from the active parameters, the MoE flavor's routing, aux loss and
its gradient injection (what a pipelined step relies on), and the TP plan's size checks."""

from __future__ import annotations

import math

import pytest
import torch

from titanlite.models import get_model_spec
from titanlite.models.moe import (
    MoE,
    MoEArgs,
    aux_loss_gradients,
    aux_losses,
    expert_load,
    load_balancing_loss,
    moe_layers,
)
from titanlite.model_spec import active_parameters
from titanlite.models.qwen3 import qwen3_flavors

VOCAB = 64
SPEC = get_model_spec("qwen3")


def build(flavor: str, **changes) -> tuple:
    args = SPEC.args_for(flavor, VOCAB)
    if changes:
        import dataclasses

        args = dataclasses.replace(args, **changes)
    model = SPEC.model_class(args)
    model.init_weights(seed=0)
    return args, model


def tokens(batch: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_weights(model, moe: bool) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names (the mapping the HF adapter will own)."""
    names = {
        "model.embed_tokens.weight": model.tok_embeddings.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.output.weight,
    }
    for i, block in model.layers.items():
        prefix, attention, ffn = f"model.layers.{i}.", block.attention, block.feed_forward
        for hf, ours in (
            ("q_proj", attention.wq),
            ("k_proj", attention.wk),
            ("v_proj", attention.wv),
            ("o_proj", attention.wo),
        ):
            names[f"{prefix}self_attn.{hf}.weight"] = ours.weight
        names[f"{prefix}self_attn.q_norm.weight"] = attention.q_norm.weight
        names[f"{prefix}self_attn.k_norm.weight"] = attention.k_norm.weight
        names[f"{prefix}input_layernorm.weight"] = block.attention_norm.weight
        names[f"{prefix}post_attention_layernorm.weight"] = block.ffn_norm.weight
        if moe:
            names[f"{prefix}mlp.gate.weight"] = ffn.router.gate.weight
            names[f"{prefix}mlp.experts.gate_up_proj"] = torch.cat([ffn.experts.w1, ffn.experts.w3], dim=1)
            names[f"{prefix}mlp.experts.down_proj"] = ffn.experts.w2
        else:
            for hf, ours in (("gate_proj", ffn.w1), ("up_proj", ffn.w3), ("down_proj", ffn.w2)):
                names[f"{prefix}mlp.{hf}.weight"] = ours.weight
    return {name: tensor.detach() for name, tensor in names.items()}


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_logits_are_transformers_qwen3s_on_the_same_weights(flavor):
    """float64 everywhere but RoPE (float32 in both, as in training): QK norm before RoPE,
    RoPE in the half layout, GQA, and the MoE router (softmax, top-k, norm_topk_prob)."""
    transformers = pytest.importorskip("transformers")
    args, model = build(flavor)
    model = model.double().eval()
    common = dict(
        vocab_size=VOCAB,
        hidden_size=args.dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    if args.moe is None:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=args.hidden_dim, **common))
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=args.hidden_dim,
            moe_intermediate_size=args.moe.hidden_dim,
            num_experts=args.moe.n_experts,
            num_experts_per_tok=args.moe.top_k,
            norm_topk_prob=True,
            experts_implementation="eager",
            **common,
        )
        hf = transformers.Qwen3MoeForCausalLM(config)
    hf = hf.double().eval()
    hf.load_state_dict(hf_weights(model, args.moe is not None), strict=True)
    with torch.no_grad():
        ours, theirs = model(tokens()), hf(tokens()).logits
    assert ours.shape == (2, 24, VOCAB)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_q_and_k_are_normalized_per_head_before_rope():
    """q_norm with unit weight leaves every head's q with norm sqrt(head_dim) whatever its
    input's scale, and RoPE (a rotation) keeps it; a head dim apart from dim / n_heads."""
    args, model = build("debugmodel")
    assert args.n_heads * args.head_dim != args.dim  # 8 x 64 = 512 against 256
    attention = model.layers["0"].attention
    q = 100 * torch.randn(2, 5, args.n_heads, args.head_dim)
    k = 0.1 * torch.randn(2, 5, args.n_kv_heads, args.head_dim)
    rotated_q, rotated_k = attention.rotate(q, k, model.rope_cache)
    for rotated in (rotated_q, rotated_k):
        torch.testing.assert_close(
            rotated.norm(dim=-1), torch.full(rotated.shape[:-1], math.sqrt(args.head_dim)), rtol=1e-4, atol=0
        )
    attention.q_norm.weight.data.fill_(2.0)  # the norm's weight scales every head
    assert torch.allclose(
        attention.rotate(q, k, model.rope_cache)[0].norm(dim=-1), 2 * rotated_q.norm(dim=-1), rtol=1e-5
    )


@torch.no_grad()
def test_the_kv_cache_decodes_the_moe_flavor_as_one_full_forward():
    """Llama's cache under Qwen3's rotate (QK norm, half-layout RoPE at the cached positions)
    and MoE blocks (eval: no counting, no aux loss)."""
    from titanlite.models.kv_cache import KVCache

    _, model = build("debugmodel_moe")
    model.eval()
    sequence = tokens(3, 12)
    full = model(sequence)
    cache = KVCache(max_len=12)
    model.enable_kv_cache(cache)
    pieces = []
    for start, stop in ((0, 5), (5, 8), *((i, i + 1) for i in range(8, 12))):
        pieces.append(model(sequence[:, start:stop]))
        cache.advance(stop - start)
    model.enable_kv_cache(None)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert all(int(layer.tokens_per_expert.sum()) == 0 for layer in moe_layers(model).values())


def test_tied_flavors_share_one_table_and_untied_ones_do_not():
    """As published: 0.6B, 1.7B and 4B tie the embedding and the head, the others do not."""
    assert {name for name, args in qwen3_flavors.items() if args.tie_word_embeddings} == {"0.6B", "1.7B", "4B"}
    untied_args, untied = build("debugmodel")
    _, tied = build("debugmodel", tie_word_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight and untied.output.weight is not untied.tok_embeddings.weight
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == VOCAB * untied_args.dim
    assert tied(tokens()).shape == (2, 24, VOCAB)


# total and activated parameters, from the model cards (Qwen/Qwen3-*), with the 151,936-token vocabulary
PUBLISHED = {
    "0.6B": (0.6e9, None),
    "1.7B": (1.7e9, None),
    "4B": (4.0e9, None),
    "8B": (8.2e9, None),
    "14B": (14.8e9, None),
    "32B": (32.8e9, None),
    "30B-A3B": (30.5e9, 3.3e9),
    "235B-A22B": (235e9, 22e9),
}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_published_sizes_have_their_parameter_counts(flavor):
    args = SPEC.args_for(flavor, 151936)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in SPEC.model_class(args).parameters())
    total, activated = PUBLISHED[flavor]
    assert n_params == pytest.approx(total, rel=0.02)
    if activated is not None:  # the model cards' activated count includes the embedding table
        assert active_parameters(args, n_params) + 151936 * args.dim == pytest.approx(activated, rel=0.03)


def test_flops_per_token_count_the_active_parameters_of_the_debug_moe_flavor():
    """By hand: each of the 6 blocks multiplies a token by q/k/v/o (256x512, 256x256 twice,
    512x256), its norms and QK norms, the router (256x8) and 2 of its 8 experts (3 x 256x256
    each); then the final norm and the untied head (256 x vocab); the embedding is a lookup."""
    args = SPEC.args_for("debugmodel_moe", VOCAB)
    attention = 256 * 512 + 2 * 256 * 256 + 512 * 256
    block = attention + 2 * 64 + 2 * 256 + 256 * 8 + 2 * 3 * 256 * 256
    active = 6 * block + 256 + 256 * VOCAB
    with torch.device("meta"):
        n_params = sum(p.numel() for p in SPEC.model_class(args).parameters())
    assert active_parameters(args, n_params) == active
    assert n_params - active == VOCAB * 256 + 6 * 6 * 3 * 256 * 256  # the embedding and 6 idle experts a block
    seq_len = 64
    assert SPEC.flops_per_token(args, n_params, seq_len) == 6 * active + 12 * 6 * 512 * seq_len
    dense = SPEC.args_for("debugmodel", VOCAB)
    with torch.device("meta"):
        dense_params = sum(p.numel() for p in SPEC.model_class(dense).parameters())
    assert active_parameters(dense, dense_params) == dense_params - VOCAB * 256


def test_the_moe_flavor_routes_records_expert_load_and_trains_its_gate_through_the_aux_loss():
    args, model = build("debugmodel_moe")
    model.train()
    layers = moe_layers(model)
    assert list(layers) == [f"layers.{i}.feed_forward" for i in range(args.n_layers)]
    model(tokens())
    load = expert_load(model)
    assert len(load) == args.n_layers and all(
        1.0 <= ratio <= args.moe.n_experts / args.moe.top_k for ratio in load.values()
    )
    assert all(int(layer.tokens_per_expert.sum()) == 2 * 24 * args.moe.top_k for layer in layers.values())
    aux = aux_losses(model)
    assert aux.item() > 0
    gate = model.layers["2"].feed_forward.router.gate.weight
    (grad,) = torch.autograd.grad(aux, gate)
    assert grad.abs().max() > 0


def test_injected_aux_loss_gradients_equal_adding_the_scaled_aux_loss_to_the_loss():
    """What a pipelined step relies on: inside `aux_loss_gradients(model, s)`, backward of
    the loss alone gives every parameter the gradient of loss + s * aux_losses(model)."""
    _, model = build("debugmodel_moe")
    model.train()
    scale = 0.25

    def gradients(inject: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if inject:
            with aux_loss_gradients(model, scale):
                model(tokens()).logsumexp(-1).mean().backward()
        else:
            loss = model(tokens()).logsumexp(-1).mean()
            (loss + scale * aux_losses(model)).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    injected, added = gradients(True), gradients(False)
    for name in added:
        torch.testing.assert_close(injected[name], added[name], rtol=1e-5, atol=1e-9, msg=name)
    assert all(layer.aux_loss_scale is None for layer in moe_layers(model).values())  # only inside the context


def test_per_sequence_aux_loss_is_the_mean_of_each_sequences_loss():
    """The form Qwen3 trains with (MoEArgs.aux_loss_per_sequence): every sequence's loss of
    its own tokens, averaged; it does not depend on which sequences share a forward."""
    args = MoEArgs(n_experts=8, top_k=2, hidden_dim=8, aux_loss_coef=0.01, aux_loss_per_sequence=True)
    moe = MoE(16, args)
    from titanlite.models.init import ShardInit

    moe.init_weights(ShardInit(moe, 0), std=0.3)
    moe.train()
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1))
    moe(x)
    together = moe.aux_loss
    alone = []
    for sequence in x:
        moe(sequence.unsqueeze(0))
        alone.append(moe.aux_loss)
        scores = torch.nn.functional.linear(sequence, moe.router.gate.weight).softmax(-1)
        counts = torch.bincount(scores.topk(2).indices.flatten(), minlength=8)
        assert alone[-1].item() == pytest.approx(0.01 * load_balancing_loss(scores, counts, args).item(), rel=1e-6)
    assert together.item() == pytest.approx(torch.stack(alone).mean().item(), rel=1e-6)


def test_tp_problems_name_what_does_not_split():
    args = SPEC.args_for("debugmodel_moe", VOCAB)
    assert SPEC.tp_problems(args, 2) == []
    problems = SPEC.tp_problems(args, 3)
    assert any("n_heads 8" in p for p in problems) and any("n_kv_heads 4" in p for p in problems)
    assert not any("ffn hidden size" in p for p in problems)  # every block is MoE: experts stay whole
    assert any("ffn hidden size 768" in p for p in SPEC.tp_problems(SPEC.args_for("debugmodel", VOCAB), 5))


def test_the_planner_counts_each_routed_copy_of_a_token_in_moe_blocks():
    """The activation estimate's feed-forward term (parallel/estimate.py), per token in bf16
    under tp 2: a dense block's SwiGLU is split by tp; an MoE block keeps the router's float32
    logits and scores and, for each of the top-2 copies, its input, the expert's four hidden
    tensors, its output and the float32 output, unsplit; blocks that mlp_only_layers keeps
    dense are averaged in."""
    from titanlite.parallel.estimate import feed_forward_per_token

    moe_args, dense_args = SPEC.args_for("debugmodel_moe", VOCAB), SPEC.args_for("debugmodel", VOCAB)
    sparse = 2 * 8 * 4 + 2 * (2 * 256 * 2 + 4 * 256 * 2 + 4 * 256)
    dense = 4 * 768 / 2 * 2
    assert feed_forward_per_token(dense_args, 2, 2) == dense
    assert feed_forward_per_token(moe_args, 2, 2) == sparse
    import dataclasses

    half = dataclasses.replace(moe_args, mlp_only_layers=(0, 1, 2))
    assert half.n_moe_layers == 3 and feed_forward_per_token(half, 2, 2) == (sparse + dense) / 2


def test_a_pipeline_stages_metadata_forward_is_not_counted():
    """torch 2.13's stages run one forward more (first, to learn shapes) on the first schedule
    call: with n microbatches and n + 1 forwards, the first one's counts are taken back out;
    with n forwards nothing is."""
    from titanlite.models import moe as moe_functions
    from titanlite.step.experts import uncounted_metadata_forwards

    _, model = build("debugmodel_moe")
    model.train()
    for extra in (True, False):
        model.zero_grad()
        moe_functions.drop_expert_counts(model)
        with uncounted_metadata_forwards(moe_functions, [model], n_microbatches=2):
            if extra:
                model(tokens(1, 24, seed=9))  # the metadata forward, on other tokens
            model(tokens(1, 24, seed=1))
            model(tokens(1, 24, seed=2))
        counted = moe_functions.token_counts(model)
        moe_functions.drop_expert_counts(model)
        model(tokens(1, 24, seed=1))
        model(tokens(1, 24, seed=2))
        assert torch.equal(counted, moe_functions.token_counts(model))
