"""Tensor parallelism for a transformers model, from the plan its config class ships
(`base_model_tp_plan`, written by the model's authors), translated to `parallelize_module`
styles. The embedding and the head are split by vocab, as in titanlite's own plans (the head
by `output_projection`, with loss parallel where asked; a tied table stays one). Every other
module holding parameters the plan does not name (the norms) becomes `ReplicateParallel`:
each parameter is then a DTensor on the tp mesh, which the grad norm and FSDP expect. The residual stream stays whole on
every rank: the plans name no norms to run on sequence shards.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titanlite.models import decoder_tp
from titanlite.models.hf.model import HFArgs
from titanlite.parallel import tensor_parallel as tp

# transformers' style names (its tensor-parallel integration's) -> the style.
STYLES = {
    "colwise": lambda: tp.ColwiseParallel(),
    "rowwise": lambda: tp.RowwiseParallel(),
    "colwise_gather_output": lambda: tp.ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: tp.RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: tp.vocab_sharded_embedding(False),
    "replicated_with_grad_allreduce": tp.norm_over_heads,
}


def hf_tp_plan(args: HFArgs) -> dict[str, str]:
    """The config's plan: decoder module patterns (`layers.*.self_attn.q_proj`) -> style names;
    without its entries inside the sparse blocks titanlite's MoE layer replaced."""
    plan = dict(args.config().base_model_tp_plan or {})
    return {key: style for key, style in plan.items() if args.moe is None or not _inside_moe(key)}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The translated plan, the head by vocab, every other parameter replicated on `tp_mesh`."""
    plan = {key: STYLES[style]() for key, style in hf_tp_plan(model.args).items()}
    plan.setdefault("embed_tokens", tp.vocab_sharded_embedding(False))
    for key in model.layers:  # titanlite's MoE layers: whole on every rank (expert parallelism splits experts)
        if model.args.moe_layer(int(key)):
            plan[f"layers.{key}.mlp"] = tp.WholeOnEachRank(sequence_parallel=False)
    plan["lm_head"] = tp.output_projection(loss_parallel, False)
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None and not _covered(name, plan):
            plan[name] = tp.ReplicateParallel(use_local_output=True)
    parallelize_module(model, tp_mesh, plan)
    if model.args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def tp_problems(args: HFArgs, tp_degree: int) -> list[str]:
    """Why this model cannot be split `tp_degree` ways: a style of its plan titanlite does not
    apply (named with its module), or a size the split does not divide."""
    unknown = [f"{key}: {style}" for key, style in hf_tp_plan(args).items() if style not in STYLES]
    if tp_degree > 1 and unknown:
        return [f"{args.model_type}'s tensor-parallel plan has styles titanlite cannot apply ({', '.join(unknown)})"]
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "ffn hidden size": args.hidden_dim}
    return decoder_tp.indivisible({**sizes, "vocab_size": args.vocab_size}, tp_degree)


def _inside_moe(key: str) -> bool:
    """Whether a plan key names a part of a sparse block (its router, experts, shared experts)."""
    _, moe, inside = key.partition(".mlp.")
    return bool(moe) and inside.split(".")[0] in ("gate", "experts", "shared_experts", "shared_expert")


def _covered(name: str, plan: dict[str, ParallelStyle]) -> bool:
    """Whether the plan places `name` or a module holding it."""
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(prefix, key) for prefix in prefixes for key in plan)
