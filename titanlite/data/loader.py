"""Packing documents into training windows, sharded by data-parallel rank, resumable.

The stream: documents from a source are tokenized (bos + tokens + eos each) and
concatenated; consecutive, non-overlapping windows of `seq_len + 1` tokens are cut from
it: w0, w1, w2, ... A window gives `inputs = w[:-1]` and `labels = w[1:]`.

Sharding: the window stream is global, the same on every rank. Each `next()` consumes one
*global microbatch* of `dp_degree * local_batch_size` consecutive windows, and dp rank r
keeps windows `[r*B, (r+1)*B)` of it (B = local_batch_size). Tensor-parallel ranks of one
dp rank pass the same `dp_rank` and so get identical batches. Hence the windows of an
optimizer step (grad-accumulation microbatches in a row) are the same set for any dp
degree as long as dp * B * accumulation is fixed: one process with B=8 reads exactly
the windows that two ranks with B=4 read together. The price of this simplicity: every
rank tokenizes the whole stream and keeps only its slice (sentencepiece is fast, so this
is cheap next to a training step, but it grows with the dp degree).

State: where the next unconsumed token is, as the source cursor of the document holding
it plus how many of that document's tokens were already used, and the global count of
windows consumed. It holds no tokens and no rank or dp degree, so it is a few ints,
identical on every rank, and a state saved at one dp degree resumes at any other with
the same next global window. Resuming re-reads and re-tokenizes that one document.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from titanlite.data.sources import Cursor, Source, build_source, make_cursor, start_cursor
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import TitanliteError
from titanlite.logging import logger

if TYPE_CHECKING:
    from titanlite.config import Training


class TokenWindowLoader:
    """Yields `(inputs, labels)`, LongTensors of shape `[local_batch_size, seq_len]`,
    forever (the source wraps around). Stateful: `state_dict()` / `load_state_dict()`:

        {"source": "builtin" | "files:<path>" | "hf:<name>",
         "windows": global windows consumed so far (all ranks together),
         "cursor": {"epoch", "item", "line", "offset"}: the document holding the next token,
         "skip_tokens": tokens of that document already consumed}
    """

    def __init__(self, source: Source, tokenizer: Tokenizer, seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        """`seq_len` and `local_batch_size` as `load_config` validated them (>= 1);
        `dp_rank` in [0, dp_degree) from the mesh, a ValueError otherwise (a caller's bug)."""
        if not (isinstance(dp_degree, int) and dp_degree >= 1 and isinstance(dp_rank, int) and 0 <= dp_rank < dp_degree):
            raise ValueError(f"dp_rank {dp_rank!r} must be in [0, dp_degree {dp_degree!r})")
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.source, self.tokenizer, self.dp_degree = source, tokenizer, dp_degree
        window = seq_len + 1
        self._group_tokens = dp_degree * local_batch_size * window  # one global microbatch
        self._mine = (dp_rank * local_batch_size * window, (dp_rank + 1) * local_batch_size * window)
        self.windows = 0  # global windows consumed
        self._seek(start_cursor(), 0)

    def _seek(self, cursor: Cursor, skip_tokens: int) -> None:
        self._docs: Iterator[tuple[str, Cursor]] | None = None  # opened lazily at next_cursor
        self._next_cursor = cursor  # the first document not yet read
        self._doc_cursor = cursor  # the last document read (its tail is in the buffer)
        self._doc_len = 0
        self._pending_skip = skip_tokens  # drop this many tokens of the next document read
        self._buf: list[int] = []
        self._pos = 0  # buffer[pos:] is the leftover: always a suffix of the last document read

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> TokenWindowLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        need = self._group_tokens
        if len(self._buf) - self._pos < need:
            del self._buf[: self._pos]
            self._pos = 0
            while len(self._buf) < need:
                self._buf.extend(self._read_document())
        start, end = self._pos + self._mine[0], self._pos + self._mine[1]
        block = torch.tensor(self._buf[start:end], dtype=torch.long).view(self.local_batch_size, self.seq_len + 1)
        self._pos += need
        self.windows += self.dp_degree * self.local_batch_size
        return block[:, :-1].contiguous(), block[:, 1:].contiguous()

    def _read_document(self) -> list[int]:
        if self._docs is None:
            self._docs = self.source.documents(self._next_cursor)
        text, following = next(self._docs)
        tokens = self.tokenizer.encode(text, bos=True, eos=True)
        self._doc_cursor, self._next_cursor, self._doc_len = self._next_cursor, following, len(tokens)
        if self._pending_skip:
            skip, self._pending_skip = self._pending_skip, 0
            if skip >= len(tokens):
                logger.warning(
                    f"data: the saved position ({skip} tokens into the document at {self._doc_cursor}) is past that "
                    f"document's end ({len(tokens)} tokens); the data changed since the save; continuing with the next document"
                )
                return []
            tokens = tokens[skip:]
        return tokens

    # ------------------------------------------------------------------ state

    def _position(self) -> tuple[Cursor, int]:
        leftover = len(self._buf) - self._pos
        if leftover:
            return self._doc_cursor, self._doc_len - leftover
        return self._next_cursor, self._pending_skip

    def state_dict(self) -> dict[str, Any]:
        cursor, skip = self._position()
        return {"source": self._source_name, "windows": self.windows, "cursor": dict(cursor), "skip_tokens": skip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            saved_source = str(state["source"])
            windows = int(state["windows"])
            cursor = make_cursor(**{k: int(state["cursor"][k]) for k in ("epoch", "item", "line", "offset")})
            skip = int(state["skip_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise TitanliteError(f"checkpoint: the saved dataloader state is not a titanlite data position ({type(e).__name__}: {e})") from None
        self.windows = windows
        current = self._source_name
        if saved_source.partition(":")[0] != current.partition(":")[0]:
            logger.warning(f"data: the checkpoint's data position is for {saved_source!r}, this run reads {current!r}; starting it from its beginning")
            self._seek(start_cursor(), 0)
            return
        if saved_source != current:
            logger.warning(f"data: the checkpoint's data position was saved for {saved_source!r}, this run reads {current!r}; resuming at the saved position as if it were the same data")
        self._seek(cursor, skip)

    @property
    def _source_name(self) -> str:
        return getattr(self.source, "name", type(self.source).__name__)


def build_dataloader(training: Training, tokenizer: Tokenizer, dp_rank: int, dp_degree: int) -> TokenWindowLoader:
    """The loader for a validated `[training]`: `dataset`, `dataset_path`, `seq_len`, `local_batch_size`."""
    source = build_source(training.dataset, training.dataset_path)
    return TokenWindowLoader(source, tokenizer, training.seq_len, training.local_batch_size, dp_rank, dp_degree)
