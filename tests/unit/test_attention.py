"""titanlite/models/attention.py and document masking in the models, on one process: the
block-causal rule, the same attention from SDPA and from flex_attention (eager on CPU: the
kernel CUDA runs compiled), a document that cannot see the one before it, and one document
per window training exactly like causal attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanlite.models import get_model_spec
from titanlite.models.attention import attend, build_mask
from titanlite.parallel.context_parallel import chunk_positions
from titanlite.step.loss import cross_entropy

DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 0]])


def test_block_causal_lets_a_token_see_only_earlier_tokens_of_its_document():
    mask = build_mask("block_causal", DOCS, None, None, flex=False)[:, 0]
    assert mask.shape == (2, 8, 8)
    assert mask[0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[0, 7].tolist() == [False] * 7 + [True]
    assert torch.equal(mask[1], torch.ones(8, 8, dtype=torch.bool).tril())
    assert build_mask("causal", DOCS, None, None, flex=False) is None  # SDPA's own causal path


def test_masks_at_context_parallel_positions_are_the_whole_masks_rows():
    """cp 2: rank 1 holds tokens 2-3 and 4-5 of 8; its rows of the mask over every key equal
    those rows of the whole sequence's mask, for both mask types."""
    positions = chunk_positions(8, 1, 2)
    keys = torch.cat([chunk_positions(8, r, 2) for r in range(2)])
    assert positions.tolist() == [2, 3, 4, 5] and sorted(keys.tolist()) == list(range(8))
    whole = build_mask("block_causal", DOCS, torch.arange(8), torch.arange(8), flex=False)[:, 0]
    local = build_mask("block_causal", DOCS, positions, keys, flex=False)[:, 0]
    assert torch.equal(local, whole[:, positions][:, :, keys])
    causal = build_mask("causal", None, positions, keys, flex=False)[0, 0]
    assert torch.equal(causal, torch.ones(8, 8, dtype=torch.bool).tril()[positions][:, keys])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_flex_attention_computes_what_sdpa_computes(mask_type):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16)
    k, v = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)  # GQA: 2 kv heads for 4 query heads
    positions = torch.arange(8)
    sdpa = attend(q, k, v, build_mask(mask_type, DOCS, positions, positions, flex=False), grouped=True)
    flex = attend(q, k, v, build_mask(mask_type, DOCS, positions, positions, flex=True), grouped=True)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq", [100, 256, 300])  # one block, two, and a partial last block
def test_causal_attention_with_narrower_values_by_query_blocks(seq):
    """MLA's shape on CPU (values narrower than keys, so no fused kernel): attention runs by
    blocks of queries over the keys up to each block's end; output and gradients equal a
    plain softmax over the causal rule in float64, and the keys after a block never matter."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, seq, 12, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, seq, 8, dtype=torch.float64, requires_grad=True)
    out = attend(q, k, v, None, grouped=False, scale=0.3)
    assert type(out.grad_fn).__name__ == "_CausalByQueryBlocksBackward"  # the blocks ran, not SDPA
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), -torch.inf)
    expected = scores.softmax(-1) @ v
    grad = torch.randn_like(out)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def model(name: str, mask_type: str, seed: int = 3):
    spec = get_model_spec(name, "debugmodel")
    net = spec.model_class(dataclasses.replace(spec.args_for("debugmodel", 256), attn_mask_type=mask_type))
    net.init_weights(seed=seed)
    return net


@pytest.mark.parametrize("name", ["llama3", "gpt2"])
def test_the_second_document_does_not_see_the_first(name):
    """Two documents share a window: changing the first document's tokens leaves the second's
    logits unchanged under block_causal, and changes them under causal."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (1, 16))
    other = tokens.clone()
    other[0, :6] = torch.randint(0, 256, (6,))
    documents = torch.tensor([[0] * 6 + [1] * 10])
    block, causal = model(name, "block_causal"), model(name, "causal")
    with torch.no_grad():
        assert torch.equal(block(tokens, documents)[0, 6:], block(other, documents)[0, 6:])
        assert not torch.allclose(causal(tokens)[0, 6:], causal(other)[0, 6:])


def test_a_window_of_one_document_gives_the_causal_loss_and_gradients():
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    block, causal = model("llama3", "block_causal"), model("llama3", "causal")
    block_loss = cross_entropy(block(tokens, torch.zeros(2, 16, dtype=torch.int32)), labels)
    causal_loss = cross_entropy(causal(tokens), labels)
    torch.testing.assert_close(block_loss, causal_loss, rtol=1e-6, atol=0)
    block_loss.backward()
    causal_loss.backward()
    torch.testing.assert_close(
        block.layers["0"].attention.wk.weight.grad, causal.layers["0"].attention.wk.weight.grad, rtol=1e-5, atol=1e-8
    )
