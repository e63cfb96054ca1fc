"""gpt-oss's attention and model pieces (models/gpt_oss/, with the shared attention, chunked
attention, KV cache and MoE options it adds): sinks and sliding windows against a plain
softmax reference written here, per context-parallel chunk and through the KV cache; the
experts' clamped SwiGLU; flavors, FLOPs and the TP checks. Against transformers:
test_gpt_oss_hf.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate

from titanlite.models.attention import attend, build_mask
from titanlite.models.chunked_attention import plan_chunks
from titanlite.models.gpt_oss import gpt_oss_flavors, gpt_oss_spec
from titanlite.models.gpt_oss.model import GptOss
from titanlite.models.kv_cache import KVCache
from titanlite.models.moe_experts import ClampedSwiGLUExperts
from titanlite.parallel.context_parallel import chunk_positions, chunk_starts
from tests.helpers.hf_gpt_oss import TINY, randomize

SEQ = 32


def reference_attention(q, k, v, sinks, window, docs=None):
    """softmax([scores, sink]) without the sink's column, times v: transformers' eager rule."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    positions = torch.arange(q.shape[2])
    allowed = build_mask("causal" if docs is None else "block_causal", docs, positions, positions, False, window)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1] @ v


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, SEQ, 8, generator=generator, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=generator, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, sinks)]


def gradients(out, tensors, seed: int = 1):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), tensors)


@pytest.mark.parametrize("window", [None, 3, 6, 12])
@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_sinks_and_windows_per_chunk_equal_the_plain_softmax(window, cp, mask_type):
    """Outputs and the gradients of q, k, v and the sinks, at one rank (the whole-sequence
    mask) and per cp rank's chunks (chunks of 8 at cp 2: windows inside one, across two, past all)."""
    docs = None if mask_type == "causal" else (torch.arange(SEQ) >= 11).int().expand(2, -1) + (torch.arange(SEQ) >= 25)
    q, k, v, sinks = inputs()
    expected = reference_attention(q, k, v, sinks, window, docs)
    expected_grads = gradients(expected, (q, k, v, sinks))
    out, grads = torch.zeros_like(expected), [torch.zeros_like(t) for t in (q, k, v, sinks)]
    for rank in range(cp):
        rows = chunk_positions(SEQ, rank, cp)
        if cp == 1:
            positions = None if window is None else torch.arange(SEQ)  # what the decoder passes
            mask = build_mask(mask_type, docs, positions, positions, False, window)
        else:
            mask = plan_chunks(mask_type, docs, chunk_starts(SEQ, rank, cp), SEQ // (2 * cp), q.dtype, window)
        part = attend(q[:, :, rows], k, v, mask, grouped=True, sinks=sinks)
        out[:, :, rows] = part.detach()
        weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
        for total, grad in zip(grads, torch.autograd.grad((part * weights[:, :, rows]).sum(), (q, k, v, sinks))):
            total += grad
    torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-10)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-10)


def test_a_window_changes_the_plan_only_where_it_cuts_into_the_keys():
    starts = chunk_starts(SEQ, 0, 2)  # chunks at 0 and 24, 8 tokens each
    wide = plan_chunks("causal", None, starts, 8, torch.float32, window=SEQ)
    assert wide == plan_chunks("causal", None, starts, 8, torch.float32)  # no cut: the causal pieces
    narrow = plan_chunks("causal", None, starts, 8, torch.float32, window=4)
    (first,), (second,) = (chunk.pieces for chunk in narrow.chunks)
    assert (first.start, first.stop, second.start, second.stop) == (0, 8, 21, 32)  # keys from 24 - 4 + 1
    assert second.bias is not None and not first.causal


def test_kv_cache_decoding_with_windows_and_sinks_equals_the_full_forward():
    """A 6-token prompt, then one token at a time past the window (4): the logits of the whole
    sequence's forward."""
    model = GptOss(TINY).double()
    model.init_weights(seed=0)
    randomize(dict(model.named_parameters()), seed=3)
    tokens = torch.randint(0, TINY.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.eval()(tokens)
        model.enable_kv_cache(cache := KVCache(max_len=14))
        outputs, start = [], 0
        for length in (6, *[1] * 8):
            outputs.append(model(tokens[:, start : start + length]))
            cache.advance(length)
            start += length
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, rtol=1e-9, atol=1e-9)


def test_the_clamped_swiglu_experts_loop_equals_a_per_token_reference():
    experts = ClampedSwiGLUExperts(3, 4, 5, alpha=1.702, limit=0.5).double()
    randomize(dict(experts.named_parameters()), seed=0)
    x, counts = torch.randn(7, 4, dtype=torch.float64), torch.tensor([2, 0, 5])
    owner = [0, 0, 2, 2, 2, 2, 2]
    want = []
    for row, e in zip(x, owner):
        gate_up = row @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        gate, up = gate_up[::2].clamp(max=0.5), gate_up[1::2].clamp(-0.5, 0.5)
        want.append((up + 1) * gate * torch.sigmoid(1.702 * gate) @ experts.down_proj[e] + experts.down_proj_bias[e])
    torch.testing.assert_close(experts(x, counts), torch.stack(want))


def test_flavors_have_the_published_shapes_and_tp_splits_heads_only():
    """20B and 120B: 20.9B and 116.8B parameters with a 201088 vocabulary (OpenAI's model card:
    21B and 117B); windows on the even blocks."""
    for name, billions in (("20B", 20.9), ("120B", 116.8)):
        args = dataclasses.replace(gpt_oss_flavors[name], vocab_size=201088)
        with torch.device("meta"):
            model = GptOss(args)
        assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == billions
        assert [args.sliding_window(i) for i in range(4)] == [128, None, 128, None]
    debug = dataclasses.replace(gpt_oss_flavors["debugmodel"], vocab_size=4096)
    assert gpt_oss_spec.tp_problems(debug, 2) == []
    assert gpt_oss_spec.tp_problems(debug, 8) == ["n_kv_heads 4 is not divisible by tensor_parallel_degree 8"]


def test_the_grouped_matmul_path_equals_the_loop(monkeypatch):
    """The path CUDA takes in bf16 (torch's grouped matmul, biases gathered per row), run here in
    float32 on CPU, where torch has the kernel: the loop's outputs and gradients."""
    from titanlite.models import moe_experts

    experts = ClampedSwiGLUExperts(3, 8, 8, alpha=1.702, limit=0.5)
    randomize(dict(experts.named_parameters()), seed=0)
    x, counts = torch.randn(9, 8, requires_grad=True), torch.tensor([4, 0, 5])
    results = []
    for grouped in (False, True):
        monkeypatch.setattr(moe_experts, "use_grouped_mm", lambda device, dtype, grouped=grouped: grouped)
        out = experts(x, counts)
        results.append((out, *gradients(out, (x, *experts.parameters()))))
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


def test_expert_tensor_parallelism_refuses_the_output_bias_in_one_line():
    """Split over tp, each rank's partial output would add the output bias again: refused when
    the run is planned, and by `parallelize` for a library user's own model."""
    from titanlite.build import plan_run
    from titanlite.config.load import load_config
    from titanlite.errors import TitanliteError
    from titanlite.parallel.expert_tensor_parallel import tp_placement

    experts = ClampedSwiGLUExperts(2, 8, 8, alpha=1.702, limit=7.0)
    refusal = "^parallelism.expert_tensor_parallel_degree: ClampedSwiGLUExperts's down_proj_bias has no"
    assert isinstance(tp_placement(experts, "down_proj_bias", False), Replicate)
    with pytest.raises(TitanliteError, match=refusal):
        tp_placement(experts, "gate_up_proj", True)
    etp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"]
    with pytest.raises(TitanliteError, match=refusal):
        plan_run(load_config(["--config", "debug_model", "--model.name", "gpt_oss", *etp]), 2, vocab_size=4096)
