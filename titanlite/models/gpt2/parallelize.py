"""The GPT-2 tensor-parallel plan (Megatron-style, with sequence parallelism).

Same layouts as the Llama plan: activations sequence-sharded between blocks, gathered on
entry to attention / MLP, colwise then rowwise linears (biases included), vocab-sharded head.
Two GPT-2 specifics:

- fused qkv: `c_attn` keeps its rows interleaved per head (see model.py), so a plain
  ColwiseParallel gives each rank whole heads of q, k and v;
- positions: the token lookup leaves as a sequence-sharded DTensor, the position table is a
  replicated DTensor on the same tp mesh, and their sum slices the positions to the local
  sequence shard (no communication); the gradient of the position table comes back whole.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleOutput, RowwiseParallel, parallelize_module

from titanlite.models.gpt2.model import GPT2Args
from titanlite.parallel import tensor_parallel as tp


class ReplicateParallel(ParallelStyle):
    """Every parameter a Replicate DTensor on the tp mesh, inputs read as replicated, the
    output left a DTensor. For a small module that every rank computes in full but whose
    output must meet sharded DTensors (here the position table)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._replicate_inputs)

    @staticmethod
    def _replicate_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Replicate(),), run_check=False) for x in inputs
        )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard c_attn/c_fc by columns and the c_proj's by rows over `tp_mesh`, LayerNorms on
    sequence shards, the token table and the head by vocab; replicate the position table."""
    parallelize_module(
        model,
        tp_mesh,
        {
            # wte: vocab-sharded lookup reduce-scattered onto sequence shards, kept a DTensor
            # so adding the replicated wpe output slices it; the sum leaves as a local shard.
            "embeddings": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1)),
            "embeddings.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
            "embeddings.wpe": ReplicateParallel(),
            "ln_f": tp.SequenceParallel(),
            "lm_head": tp.output_projection(loss_parallel),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "ln_1": tp.SequenceParallel(),
                "attn": tp.gather_sequence_on_entry(),
                "attn.c_attn": tp.ColwiseParallel(),  # per-head [q k v] rows: whole heads per rank
                "attn.c_proj": tp.rowwise_to_sequence_shards(),
                "ln_2": tp.SequenceParallel(),
                "mlp": tp.gather_sequence_on_entry(),
                "mlp.c_fc": tp.ColwiseParallel(),
                "mlp.c_proj": tp.rowwise_to_sequence_shards(),
            },
        )


def tp_problems(args: GPT2Args, tp_degree: int) -> list[str]:
    """Why this flavor cannot be split `tp_degree` ways (empty when it can)."""
    sizes = {"n_heads": args.n_heads, "mlp hidden size": args.ffn_hidden_dim, "vocab_size": args.vocab_size}
    return [f"{name} {size} is not divisible by tensor_parallel_degree {tp_degree}" for name, size in sizes.items() if size % tp_degree]
