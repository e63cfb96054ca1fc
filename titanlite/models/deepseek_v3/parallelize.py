"""The DeepSeek-V3 tensor-parallel plan: the shared decoder's edges, norms and dense SwiGLU,
MLA split by heads, and the MoE layer whole on each rank with its shared experts split.

MLA (attention.py) takes the whole sequence as a plain tensor on every tp rank, and:

- the per-head up-projections `wq` (or `wq_b`) and `wkv_b` are split by columns (whole heads
  per rank), `wo` by rows (its partial sums reduced onto the residual layout);
- the compressed latents stay whole on every rank: `wq_a`, `q_norm`, `wkv_a`, `kv_norm` have
  Replicate parameters on the tp mesh and compute in full (`tp.ReplicateParallel`, handing
  back plain tensors);
- the rotary key k_pe, whole on every rank, meets this rank's heads in `rope_key`; each
  rank's gradient there holds only its heads' part, so it is summed over the tp ranks
  (`_HeadsShareIt`), as the column-split projections sum their inputs' gradients.

Every gradient that reaches a replicated module is thereby the whole one, the same on every
rank. An MoE block's routing and routed experts run whole on each rank
(`tp.WholeOnEachRank`, as Qwen3's); its shared experts are a SwiGLU split Megatron-style
inside it (w1/w3 by columns, w2 by rows all-reduced back to the whole sequence).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from titanlite.models import decoder_tp
from titanlite.models.deepseek_v3.model_args import DeepSeekV3Args
from titanlite.models.moe import MoE
from titanlite.parallel import tensor_parallel as tp


class _HeadsShareIt(ParallelStyle):
    """A tensor whole on every tp rank, entering this rank's heads: forward unchanged, its
    gradient summed over the tp ranks (Megatron's copy-to-tensor-parallel-region): the local
    gradient is declared Partial, which the way back to Replicate all-reduces."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def enter(module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
            x, *rest = inputs
            shared = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            return (shared.to_local(grad_placements=(Partial(),)), *rest)

        module.register_forward_pre_hook(enter)
        return module


def attention_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """MLA's entries, for wq and for wq_a / q_norm / wq_b (`apply_tp` keeps those the module has)."""
    return {
        # x handed over as a plain tensor, the whole sequence (cos_sin and the mask pass through)
        "attention": PrepareModuleInput(
            input_layouts=(tp.activations_layout(sequence_parallel), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "attention.wkv_a": tp.ReplicateParallel(use_local_output=True),
        "attention.kv_norm": tp.ReplicateParallel(use_local_output=True),
        "attention.wkv_b": ColwiseParallel(),
        "attention.rope_key": _HeadsShareIt(),
        "attention.wo": tp.rowwise_exit(sequence_parallel),
        "attention.wq": ColwiseParallel(),
        "attention.wq_a": tp.ReplicateParallel(use_local_output=True),
        "attention.q_norm": tp.ReplicateParallel(use_local_output=True),
        "attention.wq_b": ColwiseParallel(),
    }


def moe_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The MoE layer whole on each rank, its shared experts (if any: `apply_tp` keeps the entries
    of those the layer has) split first."""
    return {
        "feed_forward.shared_experts.w1": ColwiseParallel(),
        "feed_forward.shared_experts.w2": RowwiseParallel(output_layouts=Replicate()),
        "feed_forward.shared_experts.w3": ColwiseParallel(),
        "feed_forward": tp.WholeOnEachRank(sequence_parallel),
    }


def mtp_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A multi-token prediction block's own modules (model.MTPBlock; `apply_tp` keeps them only
    there): its norms on the residual layout, eh_proj by columns, its output back on that layout."""
    layout = tp.activations_layout(sequence_parallel)
    norms = {name: tp.norm(sequence_parallel) for name in ("enorm", "hnorm", "norm")}
    return {**norms, "eh_proj": tp.ColwiseParallel(input_layouts=layout, output_layouts=layout)}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The shared decoder's edges (embedding, final norm, head; tied and pipeline-stage cases
    included), then every block: its norms, MLA, and the dense SwiGLU or the MoE layer; an MTP
    block's own modules too."""
    sp = sequence_parallel
    decoder_tp.apply_edges(model, tp_mesh, loss_parallel, sp)
    for block in model.layers.values():
        plan = {**decoder_tp.norms_plan(sp), **attention_plan(sp), **mtp_plan(sp)}
        if isinstance(block.feed_forward, MoE):
            plan.update(moe_plan(sp))
        else:
            plan.update(decoder_tp.feed_forward_plan(sp))
        parallelize_module(block, tp_mesh, tp.present(block, plan))


def tp_problems(args: DeepSeekV3Args, tp_degree: int) -> list[str]:
    """Why this flavor cannot be split `tp_degree` ways (empty when it can): the heads, the
    dense SwiGLU width where a block is dense, the shared experts' width, the vocabulary.
    Routed experts are not split (expert parallelism splits them)."""
    sizes = {"n_heads": args.n_heads, "vocab_size": args.vocab_size}
    if args.n_moe_layers < args.n_layers + args.mtp_depths:  # a dense block
        sizes["ffn hidden size"] = args.hidden_dim
    if args.moe is not None and args.moe.n_shared_experts:
        sizes["shared experts' hidden size"] = args.moe.n_shared_experts * args.moe.hidden_dim
    return decoder_tp.indivisible(sizes, tp_degree)
