"""GPT-2, the second registered model: sizes on meta, the fused-qkv head layout, and its
TP plan through the real trainer (gloo processes) against one process."""

from __future__ import annotations

import copy

import pytest
import torch

from titanlite.errors import TitanliteError
from titanlite.models import get_model_spec
from titanlite.models.gpt2 import GPT2, GPT2Args, gpt2_spec


def build_on_meta(args: GPT2Args) -> GPT2:
    with torch.device("meta"):
        return GPT2(args)


def tiny(seed: int = 0) -> GPT2:
    model = build_on_meta(GPT2Args(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


@pytest.mark.parametrize("flavor", ["debugmodel", "124M"])
def test_flavor_sizes_match_formula(flavor):
    args = gpt2_spec.args_for(flavor, vocab_size=50257)
    model = build_on_meta(args)
    assert all(p.is_meta for p in model.parameters())
    d, n, v, t = args.dim, args.n_layers, args.vocab_size, args.max_seq_len
    # Per block: 2 LayerNorms (2d each), c_attn 3d*d + 3d, c_proj d*d + d, c_fc 4d*d + 4d, c_proj 4d*d + d.
    per_block = 12 * d * d + 13 * d
    assert sum(p.numel() for p in model.parameters()) == n * per_block + v * d + t * d + 2 * d + v * d


def test_124M_is_openai_gpt2_plus_an_untied_head():
    model = build_on_meta(gpt2_spec.args_for("124M", vocab_size=50257))
    total = sum(p.numel() for p in model.parameters())
    assert total - model.lm_head.weight.numel() == 124_439_808  # Hugging Face's `gpt2` (tied head)


def test_flops_per_token_counts_matmul_weights_and_attention():
    args = gpt2_spec.args_for("124M", vocab_size=50257)
    n_params = sum(p.numel() for p in build_on_meta(args).parameters())
    dense = n_params - (50257 + 1024) * 768
    assert gpt2_spec.flops_per_token(args, n_params, 1024) == 6 * dense + 12 * 12 * 768 * 1024


def test_forward_shape_and_deterministic_init():
    a, b = tiny(seed=3), tiny(seed=3)
    tokens = torch.randint(0, 128, (2, 16))
    logits = a(tokens)
    assert logits.shape == (2, 16, 128)
    assert torch.equal(logits, b(tokens))
    block = a.layers["1"]
    assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)
    assert torch.all(block.attn.c_attn.bias == 0) and torch.all(block.mlp.c_proj.bias == 0)
    assert a.lm_head.bias is None
    # Residual projections start smaller: 0.02 / sqrt(2 * n_layers) = 0.01 here.
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.01, rel=0.1)
    assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_fused_qkv_rows_split_into_whole_heads():
    """What ColwiseParallel on c_attn and RowwiseParallel on c_proj do on 2 ranks, by hand:
    each rank's contiguous half of c_attn's rows must hold whole heads (their q, k and v),
    so the two ranks' partial c_proj outputs sum to the unsharded attention output."""
    torch.manual_seed(0)
    attn = tiny().layers["0"].attn
    for p in attn.parameters():  # non-zero biases, so their sharding is exercised too
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        expected = attn(x)
        total = torch.zeros_like(expected)
        for rank in range(2):
            local = copy.deepcopy(attn)
            local.c_attn = torch.nn.Linear(64, 96)
            local.c_attn.weight.copy_(attn.c_attn.weight.chunk(2, 0)[rank])
            local.c_attn.bias.copy_(attn.c_attn.bias.chunk(2, 0)[rank])
            local.c_proj = torch.nn.Linear(32, 64, bias=rank == 0)  # the row bias is added once
            local.c_proj.weight.copy_(attn.c_proj.weight.chunk(2, 1)[rank])
            if rank == 0:
                local.c_proj.bias.copy_(attn.c_proj.bias)
            total += local(x)
    torch.testing.assert_close(total, expected)


def test_registry_and_tp_problems():
    assert get_model_spec("gpt2", "debugmodel") is gpt2_spec
    with pytest.raises(TitanliteError, match="model.flavor"):
        get_model_spec("gpt2", "1.5B")
    args = gpt2_spec.args_for("124M", vocab_size=50257)
    problems = gpt2_spec.tp_problems(args, 8)
    assert problems == [
        "n_heads 12 is not divisible by tensor_parallel_degree 8",
        "vocab_size 50257 is not divisible by tensor_parallel_degree 8",
    ]
    assert gpt2_spec.tp_problems(gpt2_spec.args_for("124M", vocab_size=50304), 4) == []
