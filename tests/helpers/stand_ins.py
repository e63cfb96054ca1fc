"""Small stand-ins shared by the checkpoint tests (not tests themselves): a tiny Llama and a
data loader that only counts."""

from __future__ import annotations

from titanlite.models.llama.model import Llama, LlamaArgs

TINY = LlamaArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=32, rope_theta=500000.0
)


def tiny_model(seed: int = 0, args: LlamaArgs = TINY) -> Llama:
    model = Llama(args)
    model.init_weights(seed=seed)
    return model


class CountingLoader:
    """Stands in for the data loader in a checkpoint: a global position, the same on every rank."""

    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]
