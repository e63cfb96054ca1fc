"""Which submodules a parallelism treats as units (FSDP shards, AC or compile wraps), chosen
the ways a user of torchtitan, FSDP1 or Megatron names them, and replacing one in place.

A selector is one of: None (the model's blocks: the children of `model.layers`); class
names (the config's `fsdp_shard_modules`); a collection of module classes (Megatron's and
`ModuleWrapPolicy`'s way); or a predicate `fn(module) -> bool`. Every parallelism sees the
same choice, so a model needs no `layers` attribute when its caller says what its blocks are.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Union

from torch import nn

from titanlite.errors import TitanliteError

Selector = Union[None, Collection[str], Collection[type], Callable[[nn.Module], bool]]


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of `model.layers` (a ModuleDict or ModuleList); [] without one."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        return []
    return [(f"layers.{name}", block) for name, block in layers.named_children()]


def select(model: nn.Module, selector: Selector, option: str) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module the selector picks (never the model itself),
    in the model's order. Names of classes the model lacks are refused, naming `option`."""
    if selector is None:
        return model_blocks(model)
    if callable(selector) and not isinstance(selector, type):
        wanted = selector
    else:
        chosen = list(selector)
        if not all(isinstance(c, (str, type)) for c in chosen):
            raise TitanliteError(f"{option}: expected module classes, class names or a predicate, got {selector!r}")
        names = {c for c in chosen if isinstance(c, str)}
        classes = tuple(c for c in chosen if isinstance(c, type))
        if missing := sorted(names - {type(m).__name__ for m in model.modules()}):
            raise TitanliteError(f"{option}: no module of class {', '.join(missing)} in the model")

        def wanted(module: nn.Module) -> bool:
            return type(module).__name__ in names or isinstance(module, classes)

    return [(name, m) for name, m in model.named_modules() if m is not model and wanted(m)]


def innermost_first(picked: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The order `fully_shard` must take units in: deepest first, the model's order within a
    depth. (A parent sharded before its child leaves the child's parameters in the parent's
    group: "Cannot concatenate overlapping meshes".)"""
    return [m for _, m in sorted(picked, key=lambda item: -item[0].count("."))]


def outermost(units: list[nn.Module], model: nn.Module) -> list[nn.Module]:
    """The units no other unit contains, in the model's order (what explicit prefetch walks)."""
    inner = {id(child) for unit in units for child in unit.modules() if child is not unit}
    wanted = {id(unit) for unit in units if id(unit) not in inner}
    return [m for m in model.modules() if id(m) in wanted]


def outermost_named(picked: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """`picked` without the modules another picked module contains (wrapping both would
    checkpoint or compile the inner one twice)."""
    names = [name for name, _ in picked]
    return [(name, m) for name, m in picked if not any(name.startswith(other + ".") for other in names)]


def replace(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` is (its parent's attribute of that name)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
