"""The decoding loop: a batch of prompts stepped together, one token per row per forward.

Every row holds the same number of tokens at every step (see the package docstring): the
first forward takes the shortest prompt's length from each row, and a row whose prompt is
longer is given its own next prompt token until it runs out, then generates. With a KV
cache each forward feeds only the tokens the cache has not seen (the first forward's
prompt prefix, then one per row); without one, the whole rows again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.errors import TitanliteError
from titanlite.generate.stages import StageForward
from titanlite.logging import logger


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else drawn from
    softmax(logits / temperature) over the `top_k` likeliest (all when 0), each prompt with
    its own generator seeded by `seed`."""

    temperature: float
    top_k: int
    seed: int


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / temperature) over the top k
    (all when k is 0), on the CPU with `generator`, so every device and layout draws alike."""
    logits = logits.float().cpu()
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def decode(
    forward: StageForward,
    prompts: list[list[int]],
    max_new_tokens: int,
    max_len: int | None,
    sampling: Sampling,
    eos_id: int | None,
    kv_cache: bool,
) -> list[list[int]]:
    """Each prompt's ids followed by up to `max_new_tokens` more, a row stopping early at the
    end-of-text token (not kept) or at `max_len` tokens (the model's max_seq_len); logs how
    long that took."""
    ends = _ends(prompts, max_new_tokens, max_len)
    cached = kv_cache and forward.enable_kv_cache(max(ends))
    generators = [torch.Generator().manual_seed(sampling.seed) for _ in prompts]
    length = min(len(prompt) for prompt in prompts)
    rows = [prompt[:length] for prompt in prompts]  # what the model has been or will be fed: one length
    texts = [list(prompt) for prompt in prompts]
    active = [True] * len(prompts)
    fed, forwards, started = 0, 0, time.perf_counter()
    while any(active):
        logits = forward(torch.tensor([row[fed:] for row in rows], device=forward.device))
        forwards, fed = forwards + 1, length if cached else 0
        sampling_rows = [active[i] and length >= len(prompt) for i, prompt in enumerate(prompts)]
        chosen = _choose(logits, sampling_rows, sampling, generators, forward) if any(sampling_rows) else []
        for i, prompt in enumerate(prompts):
            if length < len(prompt):
                token = prompt[length]
            elif sampling_rows[i] and chosen[i] != eos_id:
                token = chosen[i]
                texts[i].append(token)
                active[i] = len(texts[i]) < ends[i]
            else:  # the end of text now, or a row done before: what it is fed is never read
                token, active[i] = rows[i][-1], False
            rows[i].append(token)
        length += 1
    seconds, new_tokens = time.perf_counter() - started, sum(len(t) - len(p) for t, p in zip(texts, prompts))
    how = "KV cache" if cached else "no KV cache: every forward recomputes the whole rows"
    logger.info(
        f"generate: {new_tokens} new tokens for {len(texts)} prompt(s) in {seconds:.2f} s: "
        f"{new_tokens / max(seconds, 1e-9):,.1f} tokens/s ({forwards} forwards, {how})"
    )
    return texts


def _ends(prompts: list[list[int]], max_new_tokens: int, max_len: int | None) -> list[int]:
    """How many ids each row may reach: its prompt and max_new_tokens, at most `max_len`."""
    for index, prompt in enumerate(prompts):
        if max_len is not None and len(prompt) >= max_len:
            raise TitanliteError(
                f"--prompt: prompt {index + 1} has {len(prompt)} tokens, which leave no room below "
                f"the model's max_seq_len {max_len}"
            )
    return [min(len(prompt) + max_new_tokens, max_len or len(prompt) + max_new_tokens) for prompt in prompts]


def _choose(
    logits: torch.Tensor | None,
    rows: list[bool],
    sampling: Sampling,
    generators: list[torch.Generator],
    forward: StageForward,
) -> list[int]:
    """The next token of each row in `rows` (-1 for the others), drawn on the rank that
    samples and broadcast, so every rank feeds the same tokens."""
    chosen = torch.full((len(rows),), -1, dtype=torch.long)
    if dist.get_rank() == forward.output_rank:
        for i in (i for i, sampled in enumerate(rows) if sampled):
            chosen[i] = next_token(logits[i], sampling.temperature, sampling.top_k, generators[i])
    if dist.get_world_size() > 1:
        chosen = chosen.to(forward.device)
        dist.broadcast(chosen, src=forward.output_rank)
    return chosen.tolist()
