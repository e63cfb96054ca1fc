"""The Qwen3 tensor-parallel plan: the shared decoder's (models/decoder_tp.py, Megatron-style),
plus the QK norms and the MoE feed-forward.

- q/k/v by columns (whole heads per rank), wo by rows, the dense SwiGLU w1/w3 by columns and
  w2 by rows, embedding and head by vocab: the shared decoder's styles and module names.
- `q_norm` / `k_norm` normalize each head over head_dim with one replicated weight: each rank
  normalizes the heads it holds. They are laid out as sequence-parallel norms over the head
  dim (`tp.norm_over_heads`): the weight a Replicate DTensor, the local heads a Shard(2)
  DTensor, so the weight's gradient is the sum over the ranks' heads (Partial, summed before
  the grad norm as for any sequence-parallel norm).
- An MoE feed-forward runs whole on every tp rank (`tp.WholeOnEachRank`): its router and
  routed experts are replicated, it is handed the whole sequence as a plain tensor and hands
  back the residual layout. Routing is the same on every rank (same tokens, same weights),
  so splitting experts across ranks is expert parallelism's job (parallel/expert_parallel.py,
  over data-parallel ranks): its experts arrive here already laid out and are left as they are.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from titanlite.models import decoder_tp
from titanlite.models.moe import MoE
from titanlite.models.qwen3.model import Qwen3Args
from titanlite.parallel import tensor_parallel as tp


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The shared decoder's edges (tied embeddings and pipeline stages included), then every block:
    its norms, attention and QK norms, and the SwiGLU or, in MoE blocks, the MoE layer."""
    sp = sequence_parallel
    decoder_tp.apply_edges(model, tp_mesh, loss_parallel, sp)
    for block in model.layers.values():
        plan = {**decoder_tp.norms_plan(sp), **decoder_tp.attention_plan(sp)}
        plan.update({"attention.q_norm": tp.norm_over_heads(), "attention.k_norm": tp.norm_over_heads()})
        if isinstance(block.feed_forward, MoE):
            plan["feed_forward"] = tp.WholeOnEachRank(sp)
        else:
            plan.update(decoder_tp.feed_forward_plan(sp))
        parallelize_module(block, tp_mesh, plan)


def tp_problems(args: Qwen3Args, tp_degree: int) -> list[str]:
    """Why this flavor cannot be split `tp_degree` ways (empty when it can): heads, kv heads,
    the dense SwiGLU width where a block is dense, and the vocabulary. Routed experts are
    not split."""
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "vocab_size": args.vocab_size}
    if args.n_moe_layers < args.n_layers:
        sizes["ffn hidden size"] = args.hidden_dim
    problems = decoder_tp.indivisible(sizes, tp_degree)
    if args.moe is not None and args.moe.n_shared_experts and tp_degree > 1:
        problems.append("shared experts have no tensor-parallel plan")
    return problems
