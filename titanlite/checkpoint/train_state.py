"""The trainer's own progress, saved with every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

RNG_PREFIX = "rng_rank"


def rng_key(rank: int) -> str:
    """Each rank's RNG state lives under its own key: ranks draw different random numbers
    (e.g. dropout on different data), so one shared value would be wrong for all but one."""
    return f"{RNG_PREFIX}{rank}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class TrainState(Stateful):
    """Steps taken, tokens trained on (over all data-parallel ranks), and this rank's RNG.

    `step` and `tokens_seen` are identical on every rank and saved under common keys (DCP
    writes one copy). The RNG states are per rank, under `rng_rank{r}`: a checkpoint loaded
    at a different world size has no state for new ranks; `load_state_dict` then keeps the
    seeded state, and the manager, which knows the checkpoint's keys, says so.
    """

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        rng: dict[str, torch.Tensor] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"step": self.step, "tokens_seen": self.tokens_seen, rng_key(_rank()): rng}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        if (rng := state_dict.get(rng_key(_rank()))) is None:
            return
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
