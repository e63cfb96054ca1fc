"""The KV cache (models/kv_cache.py) on a small GQA Llama: decoding piece by piece with it
gives the logits of one full forward, greedy decoding gives the tokens of recomputing the
whole sequence every step, and without a cache the forward is the training one, unchanged."""

import pytest
import torch

from titanlite.models.kv_cache import KVCache
from titanlite.models.llama.model import Llama, LlamaArgs

VOCAB, LENGTH = 100, 12


@pytest.fixture(scope="module")
def model() -> Llama:
    llama = Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32))
    llama.init_weights(seed=0)
    return llama.eval()


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_cached_pieces_give_the_full_forwards_logits_and_the_forward_is_unchanged_without_a_cache(model, tokens):
    full = model(tokens)
    cache = KVCache(max_len=LENGTH)
    model.enable_kv_cache(cache)
    pieces = []
    # A prompt, a chunk of three (a mask over cached and new keys), then one token at a time.
    for start, stop in ((0, 5), (5, 8), *((i, i + 1) for i in range(8, LENGTH))):
        pieces.append(model(tokens[:, start:stop]))
        cache.advance(stop - start)
    keys = model.layers["0"].attention.kv_cache.keys
    assert keys.shape == (3, LENGTH, 2, 16) and keys.dtype == torch.float32  # batch, tokens, kv heads, head_dim
    model.enable_kv_cache(None)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert torch.equal(model(tokens), full)
    assert all(block.attention.kv_cache is None for block in model.layers.values())


@torch.no_grad()
def test_greedy_decoding_with_the_cache_takes_the_tokens_of_full_recomputation(model, tokens):
    recomputed = tokens[:, :4]
    for _ in range(8):
        recomputed = torch.cat([recomputed, model(recomputed)[:, -1:].argmax(-1)], dim=1)
    cache = KVCache(max_len=LENGTH)
    model.enable_kv_cache(cache)
    cached, step = tokens[:, :4], tokens[:, :4]
    for _ in range(8):
        logits = model(step)
        cache.advance(step.shape[1])
        step = logits[:, -1:].argmax(-1)
        cached = torch.cat([cached, step], dim=1)
    model.enable_kv_cache(None)
    assert torch.equal(cached, recomputed)


def test_a_cache_refuses_tokens_past_its_length():
    cache = KVCache(max_len=4)
    cache.advance(3)
    assert cache.positions(1, torch.device("cpu")).tolist() == [3]
    assert cache.mask(1, torch.device("cpu")).all()  # one new query sees every cached key
    with pytest.raises(ValueError, match="max_len 4"):
        cache.positions(2, torch.device("cpu"))
