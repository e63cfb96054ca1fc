"""This data-parallel rank's training batches, read by index from prepared shards; resumable.

The global window stream (windows.py: shuffled per epoch, blended by weight) is the same on
every rank. Each `next()` consumes one *global microbatch* of `dp_degree * local_batch_size`
consecutive windows of it, and dp rank r reads windows `[r*B, (r+1)*B)` of that group (B =
local_batch_size) and nothing else. Tensor-parallel ranks of one dp rank pass the same
`dp_rank` and so get identical batches. Hence the windows of an optimizer step (its
grad-accumulation microbatches in a row) are the same set for any dp degree as long as
dp * B * accumulation is fixed, and a rank's cost per step is B window reads, whatever the
dp degree or the corpus size.

State: the number of global windows consumed, plus what they were cut from (for a warning
when a run resumes on other data). It is identical on every rank and holds no rank or dp
degree, so a state saved at one dp degree resumes at any other at the same next window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from titanlite.data.prefetch import Prefetcher
from titanlite.data.token_shards import TokenShards
from titanlite.data.windows import DatasetWindows, WindowStream, window_count
from titanlite.errors import TitanliteError
from titanlite.logging import logger

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PREFETCH_DEPTH = 2
IGNORE = -100  # the label of a token that is not trained (chat data), as in transformers and TRL


class TokenWindowLoader:
    """Yields `(inputs, labels)`, LongTensors of shape `[local_batch_size, seq_len]`, forever;
    with `documents`, `(inputs, labels, document_ids)`: the inputs' document numbers within
    each window (int32, same shape), for block-causal attention. Over chat data, the labels of
    tokens that are not trained are IGNORE. Stateful: `state_dict()` /
    `load_state_dict()` = {"windows", "data", "seq_len"}."""

    def __init__(
        self,
        stream: WindowStream,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        pin_memory: bool = False,
        prefetch: bool = True,
        documents: bool = False,
    ) -> None:
        """`dp_rank` in [0, dp_degree) from the mesh, a ValueError otherwise (a caller's bug)."""
        if not (isinstance(dp_degree, int) and isinstance(dp_rank, int) and 0 <= dp_rank < dp_degree):
            raise ValueError(f"dp_rank {dp_rank!r} must be in [0, dp_degree {dp_degree!r})")
        self.stream, self.local_batch_size = stream, local_batch_size
        self.seq_len = stream.window - 1
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.pin_memory, self.prefetch, self.documents = pin_memory, prefetch, documents
        self.windows = 0  # global windows consumed (all ranks together)
        self._prefetcher: Prefetcher | None = None

    @property
    def global_batch(self) -> int:
        return self.dp_degree * self.local_batch_size

    def batch_at(self, position: int) -> tuple[torch.Tensor, ...]:
        """This rank's batch of the global microbatch that starts at global window `position`."""
        first = position + self.dp_rank * self.local_batch_size
        windows = range(first, first + self.local_batch_size)
        block = torch.from_numpy(np.stack([self.stream.tokens(g) for g in windows]))
        batch = [block[:, :-1].contiguous(), block[:, 1:].contiguous()]
        if self.stream.masked:
            trained = torch.from_numpy(np.stack([self.stream.trained(g)[1:] for g in windows]))
            batch[1].masked_fill_(~trained, IGNORE)
        if self.documents:
            batch.append(torch.from_numpy(np.stack([self.stream.documents(g)[:-1] for g in windows])))
        return tuple(t.pin_memory() for t in batch) if self.pin_memory else tuple(batch)

    def __iter__(self) -> TokenWindowLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefetch and self._prefetcher is None:
            self._prefetcher = Prefetcher(self.batch_at, self.windows, self.global_batch, PREFETCH_DEPTH)
        batch = self._prefetcher.get() if self.prefetch else self.batch_at(self.windows)
        self.windows += self.global_batch
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (the next `next()` starts a new one)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows, "data": self.stream.name, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            windows, data, seq_len = int(state["windows"]), str(state["data"]), int(state["seq_len"])
        except (KeyError, TypeError, ValueError) as e:
            raise TitanliteError(
                f"checkpoint: the saved dataloader state is not a titanlite data position ({type(e).__name__}: {e})"
            ) from None
        if (data, seq_len) != (self.stream.name, self.seq_len):
            logger.warning(
                f"data: the checkpoint's data position was saved for {data!r} at seq_len {seq_len}; this run "
                f"reads {self.stream.name!r} at seq_len {self.seq_len}; continuing at global window {windows:,}"
            )
        self.close()
        self.windows = windows


def prepared_loader(
    folder: str,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_degree: int = 1,
    seed: int | None = 0,
    prefetch: bool = True,
    *,
    dp_mesh: DeviceMesh | None = None,
) -> TokenWindowLoader:
    """The library's loader over one prepared folder (`titanlite.prepare`, or `python -m
    titanlite.data.prepare`): windows of seq_len + 1 tokens, in a fresh order each epoch from
    `seed` (None: stream order), this dp rank's share of each global batch. Stateful (hand it
    to a `Checkpointer`): a resume at any dp degree continues at the same window.

    `dp_mesh`: `build_mesh(...).dp`, instead of dp_rank and dp_degree; None (a mesh with no
    data-parallel dimension: one process, or tp/pp/cp only) is rank 0 of 1, so a script
    passes `meshes.dp` whatever the layout."""
    if dp_mesh is not None:
        if (dp_rank, dp_degree) != (0, 1):
            raise TitanliteError("prepared_loader: give dp_mesh or dp_rank and dp_degree, not both")
        dp_rank, dp_degree = dp_mesh.get_local_rank(), dp_mesh.size()
    shards = TokenShards(folder, field="prepared_loader: folder")
    count = window_count(shards, seq_len + 1)
    if count == 0:
        raise TitanliteError(
            f"prepared_loader: {folder} holds {shards.num_tokens} tokens, fewer than one window of seq_len + 1 = "
            f"{seq_len + 1}"
        )
    stream = WindowStream([DatasetWindows(shards, seq_len + 1, 0, count, seed)], [1.0], name=str(folder))
    return TokenWindowLoader(stream, local_batch_size, dp_rank, dp_degree, prefetch=prefetch)
