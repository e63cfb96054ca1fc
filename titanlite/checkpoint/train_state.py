"""The trainer's own progress, saved with every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    """Steps taken and tokens trained on (over all data-parallel ranks)."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
