"""`errors.user_errors`: library failures become one-line user errors, except what must keep
its own path (Ctrl-C, our errors, and what the caller's `keep` recognises); a line said in one
write. (A config that does not load is refused before torch is imported: tests/runs/test_errors.py.)"""

from __future__ import annotations

import io
import sys

import pytest

from titanlite.errors import TitanliteError, one_line, say, user_errors
from titanlite.parallel.distributed import collective_failure


def test_a_library_error_becomes_one_line_naming_what_failed():
    with pytest.raises(TitanliteError) as caught, user_errors("checkpoint: saving /x failed"):
        raise ValueError("bad shard\nsecond line")
    assert str(caught.value) == "checkpoint: saving /x failed: ValueError: bad shard"


def test_interrupts_and_our_errors_pass_through():
    with pytest.raises(KeyboardInterrupt), user_errors("what"):
        raise KeyboardInterrupt
    with pytest.raises(TitanliteError, match="^mine$"), user_errors("what"):
        raise TitanliteError("mine")


def test_kept_errors_pass_through_unchanged():
    """The checkpoint save keeps a peer's death (`collective_failure`) as the trainer's
    collective line; anything it does not recognise is still a user error."""
    with pytest.raises(RuntimeError, match="peer"), user_errors("what", keep=lambda e: "peer" in str(e)):
        raise RuntimeError("peer closed")
    with pytest.raises(TitanliteError), user_errors("what", keep=collective_failure):
        raise RuntimeError("Connection closed by peer")  # not raised from inside a collective


def test_one_line_reads_the_first_failing_rank_of_a_dcp_exception():
    class CheckpointException(BaseException):
        failures = {3: (OSError("disk full"), None), 1: (ValueError("bad\nmore"), None)}

    assert one_line(CheckpointException()) == "rank 1: ValueError: bad"


class _RecordedWrites(io.RawIOBase):
    """A file whose every write(2) is kept, as the file descriptor under stderr would see it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes.append(bytes(data))
        return len(data)


def test_say_writes_a_line_in_one_write_where_print_would_take_two(monkeypatch):
    """Unbuffered stderr (PYTHONUNBUFFERED) as Python sets it up: ranks sharing the launcher's
    stderr interleave unless each line reaches the descriptor in one write."""
    raw = _RecordedWrites()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, write_through=True))
    print("titanlite: rank 1: printed", file=sys.stderr)
    assert raw.writes == [b"titanlite: rank 1: printed", b"\n"]
    raw.writes.clear()
    say("titanlite: rank 1: said")
    assert raw.writes == [b"titanlite: rank 1: said\n"]
