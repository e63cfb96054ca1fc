"""The Llama tensor-parallel plan: the shared decoder's (models/decoder_tp.py) as it is, and
which flavors it cannot split."""

from __future__ import annotations

from titanlite.models import decoder_tp
from titanlite.models.llama.model import LlamaArgs


def tp_problems(args: LlamaArgs, tp_degree: int) -> list[str]:
    """Why this flavor cannot be split `tp_degree` ways (empty when it can)."""
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "ffn hidden size": args.ffn_hidden_dim,
        "vocab_size": args.vocab_size,
    }
    return decoder_tp.indivisible(sizes, tp_degree)
