"""float8 training through torchao (`model.converters = ["float8"]`, the `[float8]` section):
the model's linear layers swapped for torchao's `Float8Linear` before EP, TP and FSDP, as
torchtitan's float8 converter does.

- The same code on every device, selected by it: a GPU with float8 matmuls (SM >= 8.9) runs
  torchao's `torch._scaled_mm` kernels, anything else (this CPU, older GPUs) torchao's
  emulation, which casts to float8 and back and multiplies in the high precision: the
  numerics of the real kernels, without their speed. torchtitan refuses emulation under
  `torch.compile`; with torchao 0.18 and torch 2.13 it compiles on this CPU (a two-layer
  model gave the eager output exactly), so titanlite allows it.
- Which linears: every `nn.Linear` whose both dims are multiples of 16 (the float8 matmul's
  alignment) and whose FQN contains none of `filter_fqns` (torchtitan's default filters the
  output head); `auto_filter_small_kn` in the list adds torchao's size heuristic (H100
  timings: linears too small to gain are left alone).
- `enable_fsdp_float8_all_gather` (tensorwise only): FSDP2 gathers each weight cast to
  float8 (one byte an element plus a scale) instead of the high-precision shards; only where
  FSDP shards, as in torchtitan. `precompute_float8_dynamic_scale_for_fsdp`: one all-reduce
  computes every weight's scale for the step's gathers, instead of one per weight
  (`precompute_scales`, which the trainer calls before each step's forward: torchtitan calls
  it after the optimizer step, the same weights, but this covers the first step and a resume).
- Checkpoints hold plain tensors (`plain_tensors`), loadable with or without float8.
- Tensor parallelism: under the tensorwise recipe the TP plan's colwise / rowwise styles and
  block entries become torchao's float8 ones (`float8_tp_style`, which the styles of
  `tensor_parallel.py` consult: the input cast to float8 before its all-gather); the rowwise
  recipes keep the plain styles (torchtitan's rule).

torchao is imported only here and only when float8 is on (`torchao_float8`): its import logs
two warnings about CUDA kernels it cannot load on a CPU build, which are silenced.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from titanlite.errors import TitanliteError
from titanlite.logging import logger
from titanlite.parallel.placement import shard_like

FLOAT8_MATMUL_CAPABILITY = (8, 9)  # Ada / Hopper and later: torch._scaled_mm
AUTO_FILTER = "auto_filter_small_kn"  # torchtitan's flag in filter_fqns
_GATHERED_WEIGHT = "WeightWithDynamicFloat8CastTensor"  # torchao's weight that FSDP gathers in float8
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")  # loggers torchao's import warns on (CUDA .so files, an Enum)


def torchao_float8() -> Any:
    """`torchao.float8`, imported quietly; a missing torchao is one line."""
    levels = {log: log.level for log in map(logging.getLogger, _IMPORT_NOISE)}
    for log in levels:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as module
    except ImportError:
        raise TitanliteError(
            'model.converters: float8 needs torchao (pip install "titanlite[float8]", torchao 0.18)'
        ) from None
    finally:
        for log, level in levels.items():
            log.setLevel(level)
    return module


def has_float8_matmuls(device_type: str) -> bool:
    """Whether `device_type` runs float8 matmuls in hardware (a CUDA GPU of SM >= 8.9)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= FLOAT8_MATMUL_CAPABILITY


def module_filter(recipe_name: str, filter_fqns: Iterable[str]) -> Callable[[nn.Module, str], bool]:
    """Which modules become Float8Linear: linears with both dims multiples of 16 whose FQN
    contains no entry of `filter_fqns` (with AUTO_FILTER, torchao's size heuristic as well)."""
    names = [name for name in filter_fqns if name != AUTO_FILTER]
    if AUTO_FILTER in filter_fqns:
        return torchao_float8()._auto_filter_for_recipe(recipe_name, filter_fqns=names)

    def convertible(module: nn.Module, fqn: str) -> bool:
        aligned = isinstance(module, nn.Linear) and all(size % 16 == 0 for size in module.weight.shape)
        return aligned and not any(name in fqn for name in names)

    return convertible


def float8_config(settings: Any, *, fsdp: bool, emulate: bool) -> Any:
    """torchao's `Float8LinearConfig` for the `[float8]` section (`settings`): the recipe's,
    emulated off float8 hardware, gathering float8 only where FSDP shards."""
    config = torchao_float8().Float8LinearConfig.from_recipe_name(settings.recipe_name)
    gather = fsdp and settings.enable_fsdp_float8_all_gather
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=gather)


def convert_to_float8(model: nn.Module, settings: Any, *, device_type: str, fsdp: bool, compile: bool) -> list[str]:
    """Swap `model`'s convertible linears for Float8Linear in place (before any other
    parallelism) and return their FQNs. `settings`: the `[float8]` section (recipe_name,
    enable_fsdp_float8_all_gather, filter_fqns)."""
    emulate = not has_float8_matmuls(device_type)
    if compile and settings.recipe_name == "rowwise":  # torchtitan's fix for pytorch#150859, as it applies it
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    convertible = module_filter(settings.recipe_name, settings.filter_fqns)
    converted = [fqn for fqn, module in model.named_modules() if convertible(module, fqn)]
    config = float8_config(settings, fsdp=fsdp, emulate=emulate)
    torchao_float8().convert_to_float8_training(model, config=config, module_filter_fn=convertible)
    how = "emulated (no float8 matmuls on this device)" if emulate else "torch._scaled_mm"
    gathered = "float8" if config.enable_fsdp_float8_all_gather else "high precision"
    under_fsdp = f"; FSDP gathers their weights in {gathered}" if fsdp else ""
    logger.info(f"float8: {len(converted)} linears ({settings.recipe_name}, {how}){under_fsdp}")
    return converted


def refuse_float8_only_units(model: nn.Module, units: list[nn.Module], settings: Any, device_type: str) -> None:
    """Under float8 all-gather (`settings`: the `[float8]` section, or None without float8) on
    gloo (CPU), which has no float8 all-gather ("Invalid scalar type"): every FSDP unit
    (`units` innermost first, then the root) must gather some parameter that is not a float8
    weight, so that FSDP packs its all-gather into bytes; a unit of float8 linears alone is
    refused in one line."""
    if settings is None or not settings.enable_fsdp_float8_all_gather or device_type != "cpu":
        return
    names = {id(module): name for name, module in model.named_modules()}
    claimed: set[int] = set()
    for unit in [*units, model]:
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        if own and all(type(getattr(p, "_local_tensor", p)).__name__ == _GATHERED_WEIGHT for p in own):
            raise TitanliteError(
                f"float8.enable_fsdp_float8_all_gather: FSDP unit {names[id(unit)] or '(root)'} holds float8 "
                "linears only, which gloo (CPU) cannot all-gather; shard it with a norm or bias beside them "
                "(parallelism.fsdp_shard_modules) or turn float8 all-gather off"
            )


def _plain(value: Any) -> Any:
    if isinstance(value, DTensor) and type(value._local_tensor).__name__ == _GATHERED_WEIGHT:
        return shard_like(value._local_tensor._tensor, value)
    return value._tensor if type(value).__name__ == _GATHERED_WEIGHT else value


def plain_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """A (nested) state dict with torchao's float8-gathered weights (WeightWithDynamicFloat8CastTensor,
    inside DTensors) as the plain tensors they wrap, sharing their storage: a checkpoint then
    holds plain tensors, which a run without float8 loads too (torch.load's weights_only refuses
    the subclass where torchao is not imported). Their AdamW state is plain already."""
    return torch.utils._pytree.tree_map(_plain, state)


def precompute_scales(parts: Iterable[nn.Module]) -> None:
    """Every float8-gathered weight's scale for the next FSDP all-gathers, from the weights as
    they are now, in one all-reduce (torchao's `precompute_float8_dynamic_scale_for_fsdp`)."""
    precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    for part in parts:
        precompute(part)


def _is_tensorwise_float8(module: nn.Module) -> bool:
    if type(module).__name__ != "Float8Linear":  # torchao is not imported unless float8 is on
        return False
    return module.config.cast_config_input.scaling_granularity is torchao_float8().ScalingGranularity.TENSORWISE


def _moves_activations(style: ParallelStyle) -> bool:
    """Whether a style redistributes activations (sequence parallelism): a block entry that
    gathers sequence shards, a rowwise exit that scatters onto them, a colwise entry from them."""
    if isinstance(style, PrepareModuleInput):
        return tuple(style.input_layouts) != tuple(style.desired_input_layouts)
    layouts = style.output_layouts if isinstance(style, RowwiseParallel) else style.input_layouts
    return any(isinstance(placement, Shard) for placement in layouts)


def float8_tp_style(style: ParallelStyle, module: nn.Module, device_mesh: DeviceMesh) -> ParallelStyle | None:
    """torchao's float8 form of a TP plan's `style` for `module`, or None to keep the style.

    torchtitan's tensorwise TP: a colwise or rowwise linear that is a tensorwise Float8Linear
    takes Float8ColwiseParallel / Float8RowwiseParallel, and a block entry (PrepareModuleInput)
    whose linears all are takes PrepareFloat8ModuleInput: the input is cast to float8 once,
    before its all-gather under sequence parallelism. The rowwise recipes keep the plain styles.
    gloo has no float8 collectives ("Invalid scalar type"), so on a CPU mesh a style that would
    move float8 tensors (sequence parallelism) stays plain: it gathers the high-precision
    activations and casts after, with the same scale (the amax of the whole tensor).
    """
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears or not all(_is_tensorwise_float8(m) for m in linears):
        return None
    if device_mesh.device_type == "cpu" and _moves_activations(style):
        return None
    from torchao.float8 import float8_tensor_parallel as styles

    if isinstance(style, PrepareModuleInput):
        converted = styles.PrepareFloat8ModuleInput()  # torchao's float8 fields; the layouts are `style`'s
    elif linears == [module]:
        kind = styles.Float8ColwiseParallel if isinstance(style, ColwiseParallel) else styles.Float8RowwiseParallel
        converted = kind.__new__(kind)
    else:
        return None
    converted.__dict__.update(style.__dict__)  # the same layouts: the styles differ only in their casts
    return converted
