"""What an FSDP option changes, seen from outside: the probes behind the option-effect tests
(tests/helpers/fsdp_options_checks.py). Each reads what FSDP2 really did, so an option
made a no-op changes what they report:

- `unit_state`: a unit's parameters between forward and backward: whole (a plain tensor),
  or a DTensor and over how many ranks (FSDP2 swaps the module's parameters);
- `fsdp_timeline` / `gathered_during`: the profiler's record of FSDP2's own spans, in
  order: which units' all-gathers ran in each unit's turn of forward or backward (unit
  k-1's all-gather in unit k's backward turn is a prefetch);
- `ops_in_backward`: aten ops dispatched while backward runs (a forward op there is a
  recomputation by activation checkpointing);
- `collectives_in`: c10d collectives dispatched by a piece of code;
- `local_bytes`: what a rank holds of a set of tensors.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = "(root)"
_SPAN = re.compile(r"^FSDP::(all_gather|pre_forward|pre_backward)(?: \((.*?)\))?(?: \[.*\])?$")


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    total = 0
    for t in tensors:
        if t is not None:
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def unit_state(unit: nn.Module) -> dict[str, Any]:
    """{"whole": every parameter a plain tensor, "ranks": over how many ranks the DTensors
    are spread (0 when whole), "local_fraction": this rank's share of the elements}."""
    params = list(unit.parameters(recurse=False)) or [next(unit.parameters())]
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if not dtensors:
        return {"whole": True, "ranks": 0, "local_fraction": 1.0}
    p = dtensors[0]
    return {"whole": False, "ranks": p.device_mesh.size(), "local_fraction": p.to_local().numel() / p.numel()}


def fsdp_timeline(fn: Callable[[], Any]) -> list[tuple[str, str, int, int]]:
    """(kind, unit, start, end) of FSDP2's all-gather, pre-forward and pre-backward spans
    while `fn` runs, in start order (kind: "all_gather", "pre_forward", "pre_backward")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    spans = []
    for event in prof.events():
        match = _SPAN.match(event.name)
        if match:
            spans.append((match.group(1), match.group(2) or ROOT, event.time_range.start, event.time_range.end))
    return sorted(spans, key=lambda s: s[2])


def gathered_during(timeline: list[tuple[str, str, int, int]], phase: str) -> dict[str, list[str]]:
    """For each unit's turn in `phase` ("pre_forward" or "pre_backward": from the start of
    its span to the start of the next unit's span of either phase), the units whose
    all-gathers started in it, in order. An explicit prefetch runs after the unit's own
    span, so a span's interval alone would miss it."""
    result: dict[str, list[str]] = {}
    current: tuple[str, str] | None = None
    for kind, unit, _, _ in timeline:
        if kind != "all_gather":
            current = (kind, unit)
            if kind == phase:
                result.setdefault(unit, [])
        elif current is not None and current[0] == phase:
            result[current[1]].append(unit)
    return result


class _OpCounter(TorchDispatchMode):
    def __init__(self, names: set[str]):
        super().__init__()
        self.names, self.counts = names, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.names or (func.namespace == "c10d" and "*c10d" in self.names):
            self.counts[f"c10d::{name}" if func.namespace == "c10d" else name] += 1
        return func(*args, **(kwargs or {}))


def ops_in_backward(loss: torch.Tensor, names: set[str]) -> Counter:
    """How many times each aten op in `names` ran during `loss.backward()`."""
    counter = _OpCounter(names)
    with counter:
        loss.backward()
    return counter.counts


def collectives_in(fn: Callable[[], Any]) -> Counter:
    """The c10d collectives `fn` dispatched, by op name."""
    counter = _OpCounter({"*c10d"})
    with counter:
        fn()
    return counter.counts
