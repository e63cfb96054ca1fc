"""Expert parallelism on one MoE layer, one rank's part: `run_checks` runs as a case of
test_parallel_equivalence.py's 2-rank session (session_worker.py), no process start of its own.

Each rank builds the same layer from one seed twice: whole (the single-process reference,
fed every rank's tokens) and split over the ep mesh (parallel/expert_parallel.apply_ep, fed
this rank's tokens). Two routers: the layer's own (uneven per-rank splits), and a skewed one
whose gate sends every token to experts 0 and 1, which ep rank 0 holds, so rank 1 sends and
receives zero rows and rank 0 computes every token (dropless: none may go missing).
Outputs, the input gradients and every weight gradient are compared with the reference's, and
with FSDP's arithmetic (`own_ranks`): each rank the whole layer on its own tokens, the weight
gradients summed over the ranks. At ep 2 that is bit for bit: each expert runs the matmuls of
the rank whose rows they are, and its weight gradient is the sum of the same two parts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titanlite.models.moe import MoE, MoEArgs
from titanlite.parallel.expert_parallel import apply_ep

DIM, TOKENS_PER_RANK = 16, 12
ARGS = MoEArgs(n_experts=8, top_k=2, hidden_dim=8, renormalize=True)


def _layer(skewed: bool) -> MoE:
    torch.manual_seed(0)
    layer = MoE(DIM, ARGS)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    if skewed:  # inputs are positive: experts 0 and 1 score highest for every token
        with torch.no_grad():
            layer.router.gate.weight.fill_(-1.0)
            layer.router.gate.weight[:2] = torch.tensor([[1.0], [0.5]])
    return layer


def _run(
    layer: MoE, x: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def _compare(skewed: bool, mesh) -> dict[str, float | list[int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x = torch.rand(world * TOKENS_PER_RANK, DIM)  # positive: see _layer
    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    weights = torch.linspace(-1, 1, x.numel()).view_as(x)  # a loss that weighs every output differently
    ref_out, ref_dx, ref_grads = _run(_layer(skewed), x, weights)
    own_out, own_dx, own_grads = _run(_layer(skewed), x[mine], weights[mine])
    split = _layer(skewed)
    apply_ep(split, mesh, None)
    out, dx, grads = _run(split, x[mine], weights[mine])
    # Each rank's experts gradient already holds every rank's tokens (the all-to-all's
    # backward); the router's holds this rank's and adds up over the ranks.
    for name, grad in grads.items():
        if isinstance(grad, DTensor):
            grads[name] = grad.full_tensor()
        else:
            dist.all_reduce(grad)
        dist.all_reduce(own_grads[name])
    counts = [int(c) for c in torch.bincount(split.router(x[mine]).experts.flatten(), minlength=ARGS.n_experts)]
    return {
        **_differences(out, dx, grads, ref_out[mine], ref_dx[mine], ref_grads),
        "own_ranks": _differences(out, dx, grads, own_out, own_dx, own_grads),
        "tokens_per_expert_here": counts,
        "local_experts": [int(split.experts.w1.to_local().shape[0])],
    }


def _differences(out, dx, grads: dict, ref_out, ref_dx, ref_grads: dict) -> dict[str, float]:
    return {
        "out": float((out - ref_out).abs().max()),
        "input_grad": float((dx - ref_dx).abs().max()),
        "weight_grads": max(float((grads[name] - ref).abs().max()) for name, ref in ref_grads.items()),
    }


def run_checks() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    result = {name: _compare(skewed, mesh) for name, skewed in (("routed", False), ("skewed", True))}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return {"ranks": gathered}
