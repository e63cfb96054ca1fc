"""models/rope.py against transformers' own RoPE inits: YaRN as DeepSeek-V3 configures it (the
frequencies, the table's magnitude and the softmax-scale correction) and Llama 3.1's scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from titanlite.models.rope import RopeScaling, YaRN, rope_cos_sin, rope_frequencies, yarn_get_mscale

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402


@dataclass(frozen=True)
class Rope:
    """The fields the tables read, as a family's args hold them."""

    head_dim: int
    rope_theta: float
    max_seq_len: int
    rope_scaling: RopeScaling = None


# DeepSeek-V3's published rope_scaling (config.json), and one whose mscale differs from
# mscale_all_dim (cos and sin then scaled by their ratio) with other betas.
DEEPSEEK_V3_YARN = YaRN(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
SKEWED_YARN = YaRN(
    factor=8.0, original_max_position_embeddings=512, beta_fast=16.0, beta_slow=2.0, mscale=0.707, mscale_all_dim=1.0
)


def deepseek_config(yarn: YaRN, rope_head_dim: int, theta: float, max_seq_len: int):
    return transformers.DeepseekV3Config(
        qk_rope_head_dim=rope_head_dim,
        max_position_embeddings=max_seq_len,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim,
        },
    )


@pytest.mark.parametrize("yarn", [DEEPSEEK_V3_YARN, SKEWED_YARN], ids=["deepseek_v3", "skewed"])
def test_yarn_equals_transformers(yarn):
    """Frequencies (ours float64, HF's float32: equal to float32's precision), the attention
    factor HF multiplies into cos and sin, the table itself, and DeepseekV3Attention's scale."""
    rope = Rope(head_dim=64, rope_theta=10000.0, max_seq_len=163840, rope_scaling=yarn)
    config = deepseek_config(yarn, rope.head_dim, rope.rope_theta, rope.max_seq_len)
    hf_freqs, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = rope_frequencies(rope)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, hf_freqs.double(), rtol=1e-6, atol=0)
    assert math.isclose(yarn.attention_factor, hf_attention_factor, rel_tol=1e-12)
    assert not torch.allclose(ours, rope_frequencies(Rope(64, 10000.0, 16)))  # scaling did something

    # The table at a few positions against HF's cos and sin (float32 angles: small positions).
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 7, 100]])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float64), positions)
    table = rope_cos_sin(rope, "cpu")[positions[0]]
    half = rope.head_dim // 2
    torch.testing.assert_close(table.real.double(), cos[0, :, :half], rtol=0, atol=1e-5)
    torch.testing.assert_close(table.imag.double(), sin[0, :, :half], rtol=0, atol=1e-5)

    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, layer_idx=0)
    assert math.isclose(yarn.softmax_scale(attention.qk_head_dim), attention.scaling, rel_tol=1e-12)


def test_yarn_mscale_is_one_without_stretch_and_scale_plain_without_mscale_all_dim():
    assert yarn_get_mscale(1.0, 0.707) == 1.0
    assert math.isclose(yarn_get_mscale(40.0, 1.0), 0.1 * math.log(40.0) + 1.0)
    plain = YaRN(factor=40.0, original_max_position_embeddings=4096)
    assert plain.softmax_scale(192) == 192**-0.5
    assert math.isclose(DEEPSEEK_V3_YARN.softmax_scale(192), 192**-0.5 * yarn_get_mscale(40.0) ** 2)


def test_rotary_dim_narrower_than_head_dim():
    """A family rotating part of each head (DeepSeek-V3: qk_rope_head_dim) gets that width."""
    rope = Rope(head_dim=192, rope_theta=10000.0, max_seq_len=8, rope_scaling=DEEPSEEK_V3_YARN)
    assert rope_cos_sin(rope, "cpu", rotary_dim=64).shape == (8, 32)
    torch.testing.assert_close(rope_frequencies(rope, 64), rope_frequencies(Rope(64, 10000.0, 8, DEEPSEEK_V3_YARN)))


def test_llama31_scaling_equals_transformers():
    scaling = (8.0, 1.0, 4.0, 8192)
    rope = Rope(head_dim=128, rope_theta=500000.0, max_seq_len=131072, rope_scaling=scaling)
    config = transformers.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    hf_freqs, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    torch.testing.assert_close(rope_frequencies(rope), hf_freqs.double(), rtol=1e-6, atol=0)
