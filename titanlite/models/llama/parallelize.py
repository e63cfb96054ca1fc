"""The Llama tensor-parallel plan (Megatron-style, with sequence parallelism)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from titanlite.models.llama.model import LlamaArgs
from titanlite.parallel import tensor_parallel as tp


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard q/k/v, w1/w3 by columns and wo/w2 by rows over `tp_mesh`, norms on sequence shards."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": tp.embedding_to_sequence_shards(),
            "norm": tp.SequenceParallel(),
            "output": tp.output_projection(loss_parallel),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": tp.SequenceParallel(),
                "attention": tp.gather_sequence_on_entry(extra_inputs=1),  # (x, rope_cache)
                "attention.wq": tp.ColwiseParallel(),
                "attention.wk": tp.ColwiseParallel(),
                "attention.wv": tp.ColwiseParallel(),
                "attention.wo": tp.rowwise_to_sequence_shards(),
                "ffn_norm": tp.SequenceParallel(),
                "feed_forward": tp.gather_sequence_on_entry(),
                "feed_forward.w1": tp.ColwiseParallel(),
                "feed_forward.w2": tp.rowwise_to_sequence_shards(),
                "feed_forward.w3": tp.ColwiseParallel(),
            },
        )


def tp_problems(args: LlamaArgs, tp_degree: int) -> list[str]:
    """Why this flavor cannot be split `tp_degree` ways (empty when it can)."""
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "ffn hidden size": args.ffn_hidden_dim,
        "vocab_size": args.vocab_size,
    }
    return [f"{name} {size} is not divisible by tensor_parallel_degree {tp_degree}" for name, size in sizes.items() if size % tp_degree]
