"""`parallelize`: titanlite's parallelisms applied to any model in their fixed order, the one
path the trainer (`build.parallelize`) and a library user's own loop share.

The order is torchtitan's: the float8 conversion of the linears (`float8.py`) before anything
else (every later step then shards and wraps Float8Linear modules), then expert parallelism
and the TP plan (they turn parameters into DTensors on the ep and tp meshes, which FSDP then
shards further; the experts first, so the TP plan finds them laid out and leaves them), LoRA's
adapters (after the plan: each takes its base weight's layout, `lora.py`), the
model's context-parallel attention, activation checkpointing and `torch.compile` per block
(so FSDP's hooks sit outside the wrappers and the compiled graphs), and last `fully_shard`
per unit, innermost first, then the root.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titanlite.errors import TitanliteError
from titanlite.parallel.lora import convert as lora_adapters
from titanlite.parallel.activation_checkpoint import apply_ac
from titanlite.parallel.compile import apply_compile
from titanlite.parallel.context_parallel import ContextParallelModel
from titanlite.parallel.expert_parallel import ExpertParallelModule, apply_ep
from titanlite.parallel.float8 import convert_to_float8, refuse_float8_only_units
from titanlite.parallel.fsdp import FsdpOptions, replicate_model, shard_model
from titanlite.parallel.mesh import Meshes
from titanlite.parallel.units import Selector, innermost_first, outermost_named, select

TPPlan = Union[None, Callable[[nn.Module, DeviceMesh], None], dict[str, ParallelStyle]]


def as_meshes(mesh: Meshes | DeviceMesh | None) -> Meshes:
    """`build_mesh`'s result as it is; a bare DeviceMesh is the FSDP mesh (2D: HSDP); None is
    one process (AC and compile only)."""
    return Meshes(world=mesh, dp=mesh, fsdp=mesh, tp=None) if mesh is None or isinstance(mesh, DeviceMesh) else mesh


def parallelize(
    model: nn.Module,
    mesh: Meshes | DeviceMesh | None,
    *,
    tp_plan: TPPlan = None,
    blocks: Selector = None,
    fsdp_modules: Selector = None,
    reshard_after_forward: bool | int | str = "default",
    mixed_precision: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    prefetch: int = 0,
    ac: str | int = "none",
    compile: bool = False,
    pipelined: bool = False,
    expert_tensor_parallel: bool = False,
    float8: Any = None,
    lora: Any = None,
) -> nn.Module:
    """Parallelize `model` in place over `mesh` (from `build_mesh`) and return it.

    tp_plan: `fn(model, tp_mesh)`, or a `parallelize_module` plan dict (FQN -> style).
    blocks: the repeated blocks AC and compile wrap (see `units.py`: class names, classes, a
        predicate); default the children of `model.layers`.
    fsdp_modules: the modules sharded one by one (nested ones too, innermost first);
        default the blocks.
    reshard_after_forward: True / False / k ranks / "default" (all but the last unit).
    mixed_precision: FSDP2's policy (compute and reduce dtypes); None keeps float32.
    cpu_offload: parameters, gradients and optimizer state on the host.
    prefetch: 0 = FSDP2's implicit one-ahead prefetch; N = the next N units, explicitly.
    ac: "none", "full", "op" (per-op selective) or k (every k-th block).
    compile: `torch.compile` each block.
    pipelined: the model is one pipeline stage: "default" resharding keeps every unit's
        weights gathered to backward, and a stage without MoE layers is allowed on an ep mesh.
    expert_tensor_parallel: split each routed expert's weights over tp (needs a tp mesh).
    float8: train the linears in float8 through torchao: the `[float8]` section (`Float8`
        from `titanlite.config`: recipe_name, enable_fsdp_float8_all_gather, filter_fqns).
    lora: train low-rank adapters on the frozen model (`lora.py`): the `[lora]` section (`LoRA`
        from `titanlite.config.lora`: rank, alpha, dropout, target_modules); applied after the TP
        plan, so each adapter is laid out like its base weight. Fill them with
        `titanlite.models.init.init_adapters(model, seed)` once the model is materialized.
    """
    meshes = as_meshes(mesh)
    _check(meshes, tp_plan, ac, prefetch, reshard_after_forward)
    _check_mesh_needs(model, meshes, expert_tensor_parallel, pipelined)
    if float8 is not None:
        convert_to_float8(model, float8, device_type=meshes.device_type, fsdp=meshes.fsdp is not None, compile=compile)
    experts = apply_ep(model, meshes.ep, meshes.tp, expert_tensor_parallel)
    if tp_plan is not None:
        tp_plan(model, meshes.tp) if callable(tp_plan) else parallelize_module(model, meshes.tp, tp_plan)
    if lora is not None:  # after the plan: each adapter is laid out like the weight it left beside it
        lora_adapters(model, lora)
    if meshes.context_parallel is not None:
        model.enable_context_parallel(meshes.context_parallel)
    names = _block_names(model, blocks, wrapped=ac != "none" or compile)
    apply_ac(model, ac, [(name, model.get_submodule(name)) for name in names])
    if compile:
        apply_compile(model, [(name, model.get_submodule(name)) for name in names])
    units = _units(model, meshes, names, fsdp_modules)
    options = FsdpOptions(mixed_precision, reshard_after_forward, cpu_offload, prefetch, pipelined)
    _data_parallel(model, meshes, units, options, experts, float8)
    return model


def _data_parallel(
    model: nn.Module, meshes: Meshes, units: list[nn.Module], options: FsdpOptions, experts: Any, float8: Any
) -> None:
    """Replicate, or FSDP's `fully_shard` per unit then the root, where the mesh has data parallelism."""
    if meshes.replicate is not None:
        replicate_model(model, meshes.replicate, units, options)
    elif meshes.fsdp is not None:
        refuse_float8_only_units(model, units, float8, meshes.fsdp.device_type)
        shard_model(model, meshes.fsdp, units, options, experts, meshes.expert_fsdp)


def _block_names(model: nn.Module, blocks: Selector, wrapped: bool) -> list[str]:
    """The outermost of the selected blocks, which AC and compile wrap (`wrapped`: one of them is on)."""
    names = [name for name, _ in outermost_named(select(model, blocks, "parallelize: blocks"))]
    if wrapped and not names:
        raise TitanliteError("parallelize: ac and compile wrap blocks: pass blocks= (the model has no `layers`)")
    return names


def _units(model: nn.Module, meshes: Meshes, blocks: list[str], fsdp_modules: Selector) -> list[nn.Module]:
    """What FSDP (or replicate) wraps one by one, where the mesh has data parallelism: the
    blocks, or the selected modules innermost first."""
    if meshes.replicate is None and meshes.fsdp is None:
        return []
    if fsdp_modules is None:
        return [model.get_submodule(name) for name in blocks]
    return innermost_first(select(model, fsdp_modules, "parallelize: fsdp_modules"))


def _check(meshes: Meshes, tp_plan: TPPlan, ac: str | int, prefetch: int, reshard: bool | int | str) -> None:
    """One line per impossible setting, before the model is touched."""
    if tp_plan is not None and meshes.tp is None:
        raise TitanliteError("parallelize: tp_plan needs a mesh with a tp dimension (build_mesh(tp=...))")
    if tp_plan is not None and not (callable(tp_plan) or isinstance(tp_plan, dict)):
        raise TitanliteError(
            "parallelize: tp_plan must be fn(model, tp_mesh) or a parallelize_module plan dict, got "
            f"{type(tp_plan).__name__}"
        )
    if not (ac in ("none", "full", "op") or (isinstance(ac, int) and not isinstance(ac, bool) and ac >= 1)):
        raise TitanliteError(
            f"parallelize: ac must be 'none', 'full', 'op' or a whole number k >= 1 (every k-th block), got {ac!r}"
        )
    if not isinstance(prefetch, int) or prefetch < 0:
        raise TitanliteError(f"parallelize: prefetch must be a whole number >= 0, got {prefetch!r}")
    if isinstance(reshard, str) and reshard not in ("default", "always", "never") and not reshard.isdigit():
        raise TitanliteError(
            f"parallelize: reshard_after_forward must be True, False, a number of ranks or 'default', got {reshard!r}"
        )
    if isinstance(reshard, int) and not isinstance(reshard, bool) and meshes.fsdp is not None:
        shards = meshes.fsdp.size(meshes.fsdp.ndim - 1)
        if reshard < 1 or shards % reshard:
            raise TitanliteError(
                f"parallelize: reshard_after_forward {reshard} ranks do not divide the {shards} FSDP shards"
            )


def _check_mesh_needs(model: nn.Module, meshes: Meshes, expert_tensor_parallel: bool, pipelined: bool) -> None:
    """What the mesh's dims need from the model: layers to split over ep (a pipeline stage
    may hold dense blocks only), context-parallel attention for cp; a tp dim for etp."""
    if expert_tensor_parallel and meshes.tp is None:
        raise TitanliteError("parallelize: expert_tensor_parallel needs a mesh with a tp dimension")
    expert_layers = any(isinstance(m, ExpertParallelModule) for m in model.modules())
    if meshes.ep is not None and not pipelined and not expert_layers:
        raise TitanliteError(
            "parallelize: the mesh has an ep dimension but the model has no layer with enable_expert_parallel"
        )
    if meshes.cp is not None and not isinstance(model, ContextParallelModel):
        raise TitanliteError(
            "parallelize: the mesh has a cp dimension but the model has no enable_context_parallel method"
        )
