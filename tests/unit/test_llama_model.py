"""Model shapes, parameter counts and FLOPs: built on meta, nothing allocated."""

import math

import pytest
import torch

from titanlite.errors import TitanliteError
from titanlite.models import get_model_spec
from titanlite.models.llama import LlamaArgs, llama3_spec
from titanlite.models.llama.model import Llama
from titanlite.models.rope import apply_rope, rope_cos_sin, rope_frequencies

# Meta's published parameter counts for Llama 3.1 and 3.2 (vocab 128256; 3.2 ties embeddings).
PUBLISHED = {
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
}
FFN_HIDDEN = {"8B": 14336, "70B": 28672, "405B": 53248, "1B": 8192, "3B": 8192}


def build_on_meta(args: LlamaArgs) -> Llama:
    with torch.device("meta"):
        return Llama(args)


@pytest.mark.parametrize("flavor", ["1B", "3B", "8B", "70B", "405B"])
def test_published_flavors_have_published_sizes(flavor):
    args = llama3_spec.args_for(flavor, vocab_size=128256)
    model = build_on_meta(args)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[flavor]
    assert args.ffn_hidden_dim == FFN_HIDDEN[flavor]
    assert model.layers["0"].attention.wk.weight.shape == (8 * args.head_dim, args.dim)  # GQA: 8 kv heads


def test_llama_3_2_flavors_tie_and_scale_rope_by_32():
    for flavor, (dim, layers, heads) in {"1B": (2048, 16, 32), "3B": (3072, 28, 24)}.items():
        args = llama3_spec.flavors[flavor]
        assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (dim, layers, heads, 8)
        assert args.tie_word_embeddings and args.rope_scaling == (32.0, 1.0, 4.0, 8192) and args.rope_theta == 500000.0
    assert not any(llama3_spec.flavors[f].tie_word_embeddings for f in ("debugmodel", "8B", "70B", "405B"))


def test_debug_model_size_matches_formula():
    args = llama3_spec.args_for("debugmodel", vocab_size=4096)
    model = build_on_meta(args)
    d, h, kv, f, v, n = args.dim, args.n_heads, args.kv_heads, args.ffn_hidden_dim, args.vocab_size, args.n_layers
    per_block = d * d * 2 + 2 * d * (kv * d // h) + 3 * d * f + 2 * d
    assert sum(p.numel() for p in model.parameters()) == n * per_block + 2 * v * d + d


def test_flops_per_token_formula():
    args = llama3_spec.args_for("8B", vocab_size=128256)
    n_params = PUBLISHED["8B"]
    seq_len = 8192
    expected = 6 * (n_params - 128256 * 4096) + 12 * 32 * 4096 * seq_len
    assert llama3_spec.flops_per_token(args, n_params, seq_len) == expected


def test_forward_shapes_and_init_is_deterministic():
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, max_seq_len=32)
    models = []
    for _ in range(2):
        model = build_on_meta(args)
        model.to_empty(device="cpu")
        model.init_weights(seed=3)
        models.append(model)
    tokens = torch.randint(0, 100, (2, 16))
    logits = models[0](tokens)
    assert logits.shape == (2, 16, 100)
    assert torch.equal(logits, models[1](tokens))
    assert torch.all(models[0].norm.weight == 1)


def test_rope_scaling_changes_only_low_frequencies():
    plain = LlamaArgs(dim=128, n_heads=1, rope_theta=500000.0)
    scaled = LlamaArgs(dim=128, n_heads=1, rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192))
    f_plain, f_scaled = rope_frequencies(plain), rope_frequencies(scaled)
    assert torch.equal(f_plain[0], f_scaled[0])  # highest frequency untouched
    assert math.isclose(float(f_scaled[-1]), float(f_plain[-1]) / 8, rel_tol=1e-12)  # lowest divided by factor


def test_rope_rotation_preserves_norm_and_position_zero():
    args = LlamaArgs(dim=32, n_heads=2, max_seq_len=8)
    x = torch.randn(1, 8, 2, 16)
    out = apply_rope(x, rope_cos_sin(args, "cpu"))
    assert torch.allclose(out[:, 0], x[:, 0])
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_registry_errors_name_the_key():
    with pytest.raises(TitanliteError, match="model.name"):
        get_model_spec("llama9")
    with pytest.raises(TitanliteError, match="model.flavor"):
        get_model_spec("llama3", "7B")
