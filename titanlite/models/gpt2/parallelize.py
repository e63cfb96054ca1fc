"""The GPT-2 tensor-parallel plan (Megatron-style; sequence parallel where it pays).

Same layouts as the Llama plan: the residual stream sequence-sharded or replicated between
blocks (`sequence_parallel`), colwise then rowwise linears (biases included),
vocab-sharded head. Two GPT-2 specifics:

- fused qkv: `c_attn` keeps its rows interleaved per head (see model.py), so a plain
  ColwiseParallel gives each rank whole heads of q, k and v;
- positions: the token lookup leaves as a DTensor in the residual layout, the position table
  is a replicated DTensor on the same tp mesh, and their sum slices the positions to the
  local sequence shard under sequence parallelism (no communication); the gradient of the
  position table comes back whole.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import PrepareModuleOutput, RowwiseParallel, parallelize_module

from titanlite.models import decoder_tp
from titanlite.models.gpt2.model import GPT2Args
from titanlite.parallel import tensor_parallel as tp


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """Shard c_attn/c_fc by columns and the c_proj's by rows over `tp_mesh`, LayerNorms on
    the residual layout, the token table and the head by vocab; replicate the position table."""
    sp = sequence_parallel
    stream = tp.activations_layout(sp)
    edges = {
        # wte: vocab-sharded lookup leaving in the residual layout, kept a DTensor so adding
        # the replicated wpe output works (and slices it under sequence parallelism); the
        # sum leaves as a local tensor.
        "embeddings": PrepareModuleOutput(output_layouts=stream, desired_output_layouts=stream),
        "embeddings.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=False),
        "embeddings.wpe": tp.ReplicateParallel(),
        "ln_f": tp.norm(sp),
        "lm_head": tp.output_projection(loss_parallel, sp),
    }
    parallelize_module(model, tp_mesh, tp.present(model, edges))
    for block in model.layers.values():
        plan = {
            "ln_1": tp.norm(sp),
            "attn": tp.block_entry(sp, extra_inputs=1),  # (x, mask)
            "attn.c_attn": tp.ColwiseParallel(),  # per-head [q k v] rows: whole heads per rank
            "attn.c_proj": tp.rowwise_exit(sp),
            "ln_2": tp.norm(sp),
            "mlp": tp.block_entry(sp),
            "mlp.c_fc": tp.ColwiseParallel(),
            "mlp.c_proj": tp.rowwise_exit(sp),
        }
        parallelize_module(block, tp_mesh, plan)


def tp_problems(args: GPT2Args, tp_degree: int) -> list[str]:
    """Why this flavor cannot be split `tp_degree` ways (empty when it can)."""
    sizes = {"n_heads": args.n_heads, "mlp hidden size": args.ffn_hidden_dim, "vocab_size": args.vocab_size}
    return decoder_tp.indivisible(sizes, tp_degree)
