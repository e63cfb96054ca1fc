"""The `titanlite` logger: rank 0 only unless asked, one line per event."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("titanlite")


def init_logger(rank: int, log_all_ranks: bool = False) -> None:
    """Log INFO on rank 0 (or on every rank, prefixed), warnings and errors from every rank."""
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[rank{rank}] " if log_all_ranks else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 or log_all_ranks else logging.WARNING)
    logger.propagate = False
