"""FSDP2: `fully_shard` each unit (the blocks by default), then the root, on the data-parallel
mesh; or, with nothing to shard, FSDP2's `replicate` (whole weights, gradients all-reduced)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from titanlite.parallel.units import outermost


def reshard_policy(setting: str | bool | int, last: bool, pipelined: bool) -> bool | int:
    """`reshard_after_forward` for one unit: True, False, or an int (reshard to groups of
    that many ranks, FSDP2's middle ground for nodes). `setting` is the config's string
    ("default", "always", "never", "k") or the library's bool or int."""
    if isinstance(setting, (bool, int)):
        return setting
    if setting.isdigit():
        return int(setting)
    return {"always": True, "never": False, "default": not (last or pipelined)}[setting]


def shard_dim(shards: int):
    """FSDP2's `shard_placement_fn` over `shards` ranks: a parameter with fewer rows than ranks
    (an MoE layer's stacked experts [E, ...] or its router [E, dim] once the ranks outnumber the
    experts: 128 experts over 512 ranks) is sharded along its first later dim the ranks divide
    (FSDP2 shards other dims than 0 only evenly), as torchtitan shards experts, so every rank
    holds an equal block instead of a quarter of the ranks holding one expert each and the
    rest none. Everything else takes FSDP's dim 0, as does a tensor-parallel DTensor (FSDP2
    shards TP parameters along dim 0 only)."""

    def placement(param: nn.Parameter) -> Shard | None:
        return None if param.shape[0] >= shards or isinstance(param, DTensor) else _later_dim(param, shards)

    return placement


def expert_shard_dim(ep: int, shards: int):
    """`shard_dim` for expert weights already split over `ep` ranks (Shard(0) DTensors on the
    ep mesh), sharded further over `shards` efsdp ranks: dim 0 (the local experts) while there
    are as many local experts as shards, else the first later dim the shards divide (128
    experts at ep 64 leave 2 per rank for 8 efsdp ranks)."""

    def placement(param: nn.Parameter) -> Shard | None:
        return None if param.shape[0] // ep >= shards else _later_dim(param, shards)

    return placement


def _later_dim(param: nn.Parameter, shards: int) -> Shard | None:
    """Shard(d) for the first dim after 0 that `shards` divides evenly, or None (dim 0)."""
    return next((Shard(d) for d in range(1, param.ndim) if param.shape[d] % shards == 0), None)


@dataclass(frozen=True)
class FsdpOptions:
    """How each unit is sharded (or replicated): FSDP2's precision policy, `reshard_after_forward`
    (see `shard_model`), parameters and gradients in host memory (`cpu_offload`), the next
    `prefetch_depth` units all-gathered explicitly (0: FSDP2's implicit one-ahead), the model
    one pipeline stage (`pipelined`), and parameters left unsharded (FSDP1's ignored_modules)."""

    mp_policy: MixedPrecisionPolicy | None = None  # None: float32 throughout
    reshard_after_forward: str | bool | int = "default"
    cpu_offload: bool = False
    prefetch_depth: int = 0
    pipelined: bool = False
    ignored_params: set[nn.Parameter] | None = None

    def config(self, mesh: DeviceMesh, shard: bool = True) -> dict:
        """`fully_shard`'s keywords over `mesh` but `reshard_after_forward` (`replicate`'s: not `shard`)."""
        config = {"mesh": mesh, "mp_policy": self.mp_policy or MixedPrecisionPolicy()}
        if shard:
            config["shard_placement_fn"] = shard_dim(mesh.size(mesh.ndim - 1))
        if self.ignored_params:  # left unsharded, as they are
            config["ignored_params"] = self.ignored_params
        if self.cpu_offload:
            # Pinned host memory speeds host<->GPU copies; there is nothing to pin for without one.
            config["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return config


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    units: list[nn.Module],
    options: FsdpOptions,
    experts: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """`fully_shard` each unit (innermost first, see `units.innermost_first`), then the root,
    over `mesh` (2D replicate x shard means HSDP); first the `experts` over `expert_mesh`.

    reshard_after_forward: "always" (True) frees every unit's gathered weights after forward
    (least memory), "never" (False) keeps them to backward (no re-gather), a number k keeps
    them gathered over groups of k ranks (a node's, say: backward re-gathers within it),
    "default" reshards all but the last unit, whose weights backward needs first anyway; in a
    pipeline stage (`pipelined`) "default" keeps them all, as torchtitan does: the schedule
    runs several microbatches' forwards before their backwards, and resharding would
    all-gather again for each.
    """
    config, reshard = options.config(mesh), options.reshard_after_forward
    if experts:
        _shard_experts(experts, expert_mesh, mesh.size(), config, reshard_policy(reshard, False, options.pipelined))
    for index, unit in enumerate(units):
        policy = reshard_policy(reshard, index == len(units) - 1, options.pipelined)
        fully_shard(unit, reshard_after_forward=policy, **config)
    fully_shard(model, reshard_after_forward=reshard is True or reshard == "always", **config)
    if options.prefetch_depth > 0:
        set_explicit_prefetch(outermost(units, model), options.prefetch_depth)


def _shard_experts(experts: list[nn.Module], mesh: DeviceMesh, ranks: int, config: dict, policy: bool | int) -> None:
    """`fully_shard` each experts module over the efsdp ranks (2-D with dp_replicate: the
    experts' HSDP). Each rank's experts gradient already sums its ep group's tokens, so the
    reduction divides by every data-parallel rank (`ranks`: dp_replicate x dp_shard x cp),
    not only the expert mesh's. FSDP2 divides by such a factor inside the collective (NCCL's
    PREMUL_SUM) unless told to sum and divide apart, which is what gloo can do."""
    ep, shards = ranks // mesh.size(), mesh.size(mesh.ndim - 1)
    options = {**config, "mesh": mesh, "shard_placement_fn": expert_shard_dim(ep, shards)}
    for module in experts:  # a reshard to k ranks (k dividing dp_shard x cp) is a full reshard here
        fully_shard(module, reshard_after_forward=policy if isinstance(policy, bool) else True, **options)
        module.set_gradient_divide_factor(float(ranks))
        # One efsdp rank: torch 2.13 divides the local copy by the factor (then sums over
        # dp_replicate), and would divide twice if this were set.
        if shards > 1:
            module.set_force_sum_reduction_for_comms(True)  # a sum, then a division: gloo has no PREMUL_SUM


def replicate_model(model: nn.Module, mesh: DeviceMesh, units: list[nn.Module], options: FsdpOptions) -> None:
    """Replicate-only data parallelism: PyTorch's composable `replicate` (FSDP2's machinery
    with nothing sharded, as torchtitan applies it) on each unit, then the root. Every rank
    keeps whole weights (Replicate DTensors on `mesh`) and each unit's gradients are
    all-reduced (averaged) as backward leaves it, so the reduction overlaps the rest of
    backward as DDP's buckets do; there is no all-gather."""
    config = options.config(mesh, shard=False)
    for unit in units:
        replicate(unit, **config)
    replicate(model, **config)


def set_explicit_prefetch(units: list[nn.Module], depth: int) -> None:
    """All-gather the next `depth` units' weights while the current one computes, in both
    directions, instead of relying on FSDP2's implicit one-ahead prefetch."""
    for index, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(0, index - depth) : index][::-1])


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (False) or do (True) the reduce-scatter / all-reduce at the end of backward.

    Gradient accumulation turns it off for every microbatch but the last, so gradients
    accumulate unsharded locally and are reduced once per step.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
