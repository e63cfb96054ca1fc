"""Small stand-ins shared by the checkpoint tests (not tests themselves)."""

from __future__ import annotations


class CountingLoader:
    """Stands in for the data loader in a checkpoint: a global position, the same on every rank."""

    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]
