"""Rotary position embeddings for every decoder family: the frequency tables (plain, Llama 3.1's
long-context scaling, YaRN as DeepSeek-V3 uses it), the complex cos + i*sin table, and the two
layouts a head's features are rotated in (interleaved pairs, Meta's and DeepSeek's weights; halves,
Hugging Face's `rotate_half`, Qwen3's weights). No family owns them, so none imports another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

# Llama 3.1 scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
Llama31Scaling = tuple[float, float, float, int]


@dataclass(frozen=True)
class YaRN:
    """YaRN frequency scaling (arXiv 2309.00071) with DeepSeek's softmax-scale correction; the
    fields are Hugging Face's `rope_parameters` keys of a `"rope_type": "yarn"` config."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    # 0: no softmax-scale correction (DeepSeek-V3 sets 1.0, as mscale).
    mscale_all_dim: float = 0.0
    # The ramp's ends rounded outwards to whole pairs (HF's default); gpt-oss sets false.
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        """The magnitude HF multiplies into cos and sin (1.0 when mscale equals mscale_all_dim,
        as in DeepSeek-V3's config)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    def softmax_scale(self, head_dim: int) -> float:
        """Attention's score scale: head_dim**-0.5, times mscale**2 when mscale_all_dim is set
        (HF's DeepseekV3Attention and DeepSeek's reference code)."""
        scale = head_dim**-0.5
        if self.mscale_all_dim:
            scale *= yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2
        return scale


RopeScaling = Llama31Scaling | YaRN | None


class RopeArgs(Protocol):
    """What the tables read from a family's args."""

    rope_theta: float
    max_seq_len: int

    @property
    def head_dim(self) -> int: ...

    @property
    def rope_scaling(self) -> RopeScaling: ...


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(args: RopeArgs, rotary_dim: int | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies [rotary_dim/2] in float64 (rotary_dim: args.head_dim unless
    only part of a head rotates, as DeepSeek-V3's qk_rope_head_dim), scaled by args.rope_scaling."""
    dim = rotary_dim or args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return freqs
    if isinstance(scaling, YaRN):
        return _yarn(freqs, dim, args.rope_theta, scaling)
    return _llama31(freqs, scaling)


def _llama31(freqs: torch.Tensor, scaling: Llama31Scaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor, low_freq_factor, high_freq_factor, old_context = scaling
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > old_context / low_freq_factor, freqs / factor, interpolated)
    return torch.where(wavelen < old_context / high_freq_factor, freqs, scaled)


def _yarn(freqs: torch.Tensor, dim: int, theta: float, yarn: YaRN) -> torch.Tensor:
    """YaRN: pairs that turn fewer than `beta_slow` times over the original context are divided
    by `factor`, those that turn more than `beta_fast` times are kept, a linear ramp between
    (the ramp's ends rounded outwards unless `truncate` is false, as HF's)."""

    def pair_index(rotations: float) -> float:  # the pair that turns `rotations` times over the context
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(yarn.beta_fast), pair_index(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    interpolated = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / yarn.factor * interpolated + freqs * (1 - interpolated)


def rope_cos_sin(args: RopeArgs, device: torch.device | str, rotary_dim: int | None = None) -> torch.Tensor:
    """cos + i*sin of every position's rotation angles, complex64: [max_seq_len, rotary_dim/2]
    (times YaRN's attention factor, as HF scales its cos and sin).

    Complex, so that RoPE is one complex multiply (no stack/cat copies), and because FSDP's
    mixed precision casts only floating-point block inputs: the angles stay in float32
    precision even when the blocks compute in bf16.
    """
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), rope_frequencies(args, rotary_dim))
    magnitude = args.rope_scaling.attention_factor if isinstance(args.rope_scaling, YaRN) else 1.0
    return torch.polar(torch.full_like(angles, magnitude), angles).to(device=device, dtype=torch.complex64)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) of x: [batch, seq, heads, head_dim], in float32.

    Each pair is the complex number x0 + i*x1; rotating it by an angle is multiplying by
    cos + i*sin, which one vectorized kernel does forward and one backward."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rotated = pairs * cos_sin[: x.shape[1]].unsqueeze(1)  # [seq, 1, head_dim/2] over the heads
    return torch.view_as_real(rotated).flatten(-2).type_as(x)


def apply_rope_half(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i + head_dim/2}) of x [batch, seq, heads, head_dim] by the
    angles of `cos_sin` (the complex table [seq, head_dim/2]), in float32: HF's
    `x * cos + rotate_half(x) * sin`."""
    first, second = x.float().unflatten(-1, (2, -1)).unbind(-2)
    rotation = cos_sin[: x.shape[1]].unsqueeze(1)  # [seq, 1, head_dim/2] over the heads
    cos, sin = rotation.real, rotation.imag
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).type_as(x)
