"""Expert parallelism: a mixture-of-experts layer's routed experts split over the "ep" ranks.

The ep ranks are borrowed from the data-parallel ones (dp_shard x cp, as torchtitan borrows
them): ep rank i of a group holds experts [i * E/ep, (i+1) * E/ep) and computes only those,
for the tokens of every rank of its group. Each rank routes its own tokens as before (the
router, top-k, aux loss, bias and load counts see exactly what one process would), then:

1. the tokens each rank sends to each expert (its per-expert counts) go out first, in one
   all-to-all of E integers, so every rank knows how many rows it will receive from whom;
2. the routed rows, already sorted by expert (so grouped by destination rank), are
   dispatched with one `all_to_all_single` with per-rank splits (uneven and zero splits
   allowed: dropless, no capacity, no padding); they arrive grouped by source rank, each
   source's rows sorted by expert;
3. the local experts run over each source's rows apart, the matmuls that rank would run
   without ep (so each expert's weight gradient is the same sum of the same per-rank parts as
   FSDP's reduction: bit for bit at ep 2); the outputs go back by the reverse all-to-all.

The all-to-alls are torch's autograd-aware functional collective
(`all_to_all_single_autograd`: the backward is the reverse exchange), which gloo runs on CPU.

Weights: each expert parameter is a DTensor sharded on dim 0 over the ep mesh (and
replicated over tp, whose ranks compute the same tokens), so checkpoints hold the stacked
`[E, ...]` tensor whatever the layout. FSDP then shards the experts over the data-parallel
ranks left after ep ("efsdp"), a `fully_shard` of its own before the block's, whose gradient
reduction divides by all dp_shard x cp ranks: every rank's experts gradient already sums the
contributions of the tokens of its whole ep group.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titanlite.parallel.expert_tensor_parallel import TensorParallelExperts, exchange_over_tp, tp_placement


class ExpertParallel:
    """This rank's place on the ep mesh, and the token exchange around its local experts."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.size = mesh.size()

    def run(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`experts(rows, local_counts)` applied to every routed row of `x` [n, dim] (sorted by
        global expert, `counts` [E] rows each) by the rank that holds its expert; returns the
        outputs in `x`'s order."""
        local = counts.numel() // self.size
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank, local expert]
        received = received.view(self.size, local)
        sent = counts.view(self.size, local).sum(dim=1).tolist()
        arriving = received.sum(dim=1).tolist()
        rows = all_to_all_single_autograd(x, arriving, sent, self.group)
        # Each source rank's rows (sorted by expert) through the local experts on their own: the
        # matmuls its rank computes without ep, on the same rows. One call over every source's
        # rows regrouped by expert summed each expert's weight gradient in another order and ran
        # other matmul shapes: rounding that trained ep 2 2e-5 apart from FSDP 2 by step 4.
        out = torch.cat([experts(part, n) for part, n in zip(rows.split(arriving), received)])
        return all_to_all_single_autograd(out, sent, arriving, self.group)


@runtime_checkable
class ExpertParallelModule(Protocol):
    """A layer whose routed experts expert parallelism can split (models/moe.MoE)."""

    def enable_expert_parallel(self, expert_parallel: ExpertParallel) -> nn.Module:
        """Run the routed experts this way from now on; return the experts module, whose
        parameters `shard_experts` lays out."""
        ...


def shard_experts(
    experts: nn.Module, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, split_over_tp: bool
) -> None:
    """Each parameter of `experts` (stacked, dim 0 = expert) a DTensor Shard(0) over
    `ep_mesh` when given, and over `tp_mesh` when given Replicate, or with expert tensor
    parallelism (`split_over_tp`) Shard(its hidden dim) (parallel/expert_tensor_parallel.py)."""
    meshes = [mesh for mesh in (ep_mesh, tp_mesh) if mesh is not None]
    mesh = meshes[0] if len(meshes) == 1 else DeviceMesh._concatenate(meshes)
    for name, param in list(experts.named_parameters(recurse=False)):
        over_ep = [Shard(0)] if ep_mesh is not None else []
        placements = over_ep + ([tp_placement(experts, name, split_over_tp)] if tp_mesh is not None else [])
        sharded = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    if split_over_tp:
        exchange_over_tp(experts, tp_mesh)


def apply_ep(
    model: nn.Module, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, split_over_tp: bool = False
) -> list[nn.Module]:
    """Split every expert-parallel layer's experts over `ep_mesh` (replicated over `tp_mesh`
    when given, or split over it with expert tensor parallelism); returns the experts
    modules, which FSDP shards on their own mesh. Without an ep mesh, expert tensor
    parallelism alone (`split_over_tp`) splits every routed-experts module over `tp_mesh`."""
    if ep_mesh is None:
        for experts in [m for m in model.modules() if split_over_tp and isinstance(m, TensorParallelExperts)]:
            shard_experts(experts, None, tp_mesh, split_over_tp=True)
        return []
    expert_parallel = ExpertParallel(ep_mesh)
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelModule)]
    units = [layer.enable_expert_parallel(expert_parallel) for layer in layers]
    for experts in units:
        shard_experts(experts, ep_mesh, tp_mesh, split_over_tp)
    return units
