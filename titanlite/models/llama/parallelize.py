"""The Llama tensor-parallel plan (Megatron-style; sequence parallel where it pays)."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from titanlite.models.llama.model import LlamaArgs
from titanlite.parallel import tensor_parallel as tp


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    sequence_parallel: bool,
    skip_feed_forward: Collection[str] = (),
) -> None:
    """Shard q/k/v, w1/w3 by columns and wo/w2 by rows over `tp_mesh`, the embedding and the
    head by vocab; the residual stream sequence-sharded or replicated (`sequence_parallel`).
    `skip_feed_forward`: blocks (keys of `model.layers`) whose feed-forward another plan lays
    out (Qwen3's MoE layers).

    A pipeline stage holds some of the blocks and the embedding or head only where it has them.
    With tied embeddings both modules shard the one table by vocab rows (Shard(0)), but each
    style swaps in its own DTensor parameter, so the tie is restored on the embedding's.
    """
    sp = sequence_parallel
    parallelize_module(
        model,
        tp_mesh,
        tp.present(
            model,
            {
                "tok_embeddings": tp.vocab_sharded_embedding(sp),
                "norm": tp.norm(sp),
                "output": tp.output_projection(loss_parallel, sp),
            },
        ),
    )
    if model.args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.sequence_shards = tp_mesh.size() if sp else 1
    for name, block in model.layers.items():
        plan = {
            "attention_norm": tp.norm(sp),
            "attention": tp.block_entry(sp, extra_inputs=2),  # (x, cos_sin, mask)
            "attention.wq": tp.ColwiseParallel(),
            "attention.wk": tp.ColwiseParallel(),
            "attention.wv": tp.ColwiseParallel(),
            "attention.wo": tp.rowwise_exit(sp),
            "ffn_norm": tp.norm(sp),
        }
        if name not in skip_feed_forward:
            plan.update(
                {
                    "feed_forward": tp.block_entry(sp),
                    "feed_forward.w1": tp.ColwiseParallel(),
                    "feed_forward.w2": tp.rowwise_exit(sp),
                    "feed_forward.w3": tp.ColwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)


def tp_problems(args: LlamaArgs, tp_degree: int) -> list[str]:
    """Why this flavor cannot be split `tp_degree` ways (empty when it can)."""
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "ffn hidden size": args.ffn_hidden_dim,
        "vocab_size": args.vocab_size,
    }
    return [
        f"{name} {size} is not divisible by tensor_parallel_degree {tp_degree}"
        for name, size in sizes.items()
        if size % tp_degree
    ]
