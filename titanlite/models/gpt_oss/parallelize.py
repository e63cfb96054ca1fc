"""The gpt-oss tensor-parallel plan: the shared decoder's edges, norms and GQA attention, the
sinks split with the heads, and the MoE layer whole on each rank.

- q/k/v by columns (whole heads per rank; their biases split with their rows), wo by rows (its
  bias added once, after the partial sums are reduced), embedding and head by vocab;
- `sinks` (one logit per query head) a Shard(0) DTensor: a rank holds the sinks of the heads
  its column block of wq holds, and attention reads them as a local tensor;
- the MoE layer (router, biases and experts) runs whole on each tp rank (`tp.WholeOnEachRank`),
  as Qwen3's; expert parallelism splits the experts (parallel/expert_parallel.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from titanlite.models import decoder_tp
from titanlite.models.gpt_oss.model import GptOssArgs
from titanlite.parallel import tensor_parallel as tp


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The shared decoder's edges, then every block: its norms, attention (and sinks by head)
    and the MoE layer whole on each rank."""
    sp = sequence_parallel
    decoder_tp.apply_edges(model, tp_mesh, loss_parallel, sp)
    for block in model.layers.values():
        plan = {**decoder_tp.norms_plan(sp), **decoder_tp.attention_plan(sp), "feed_forward": tp.WholeOnEachRank(sp)}
        parallelize_module(block, tp_mesh, plan)
        sinks = block.attention.sinks
        sharded = distribute_tensor(sinks.data, tp_mesh, [Shard(0)], src_data_rank=None)
        block.attention.sinks = nn.Parameter(sharded, requires_grad=sinks.requires_grad)


def tp_problems(args: GptOssArgs, tp_degree: int) -> list[str]:
    """Why this flavor cannot be split `tp_degree` ways (empty when it can): heads, kv heads and
    the vocabulary. Routed experts are not split (expert parallelism splits them)."""
    return decoder_tp.indivisible(
        {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "vocab_size": args.vocab_size}, tp_degree
    )
