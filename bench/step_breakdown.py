"""Where a training step's time goes, by part of the model: attention, the MoE router, the
token permutation and combine, the routed experts, the shared experts, the dense MLPs, the
norms, the embedding and the head, each forward and backward; the loss, the optimizer, and
the rest (block glue: residual adds, the RoPE table lookup, the autograd engine, Python).

    python bench/step_breakdown.py [--models family:flavor,...] [--steps 4] [--warmup-steps 2]
                                   [--seq-len 256] [--batch 4] [--vocab 4096]

One process, float32, eager, a plain loop on random tokens (forward, cross-entropy plus the
MoE aux loss, backward, fused AdamW, the expert-bias update), as bench/moe_throughput.py.
Method: the measured steps run under torch.profiler (CPU activity). Forward hooks open a
`record_function` range around each part's module: the MoE layer's own range less the ranges
of its router, experts and shared experts inside it is the permutation and combine (sort,
gather, the weighted sum). Each backward op (autograd's `evaluate_function` event) is charged
to the part whose range ran the forward op of the same autograd sequence number; the
gradient accumulation of the leaves and backward ops of forward ops outside any part go to
"rest". Shares are of the profiled step (the profiler's own overhead included); the unprofiled
wall time per step is printed beside them. Nothing is asserted.

Why: issue 50 asks where a DeepSeek-V3 step's time goes against Llama's and Qwen3-MoE's,
before anything is made faster. FSDP 2 against ep 2 by the same parts (plus the all-to-all and
FSDP's collectives) is bench/moe_ep.py's; torchtitan's whole step beside titanlite's, per
layout, is bench/torchtitan_baseline.py's. torchtitan's step is not split by part here.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from titanlite.models import get_model_spec  # noqa: E402
from titanlite.models.decoder import Attention, FeedForward  # noqa: E402
from titanlite.models.deepseek_v3.attention import MLA  # noqa: E402
from titanlite.models.moe import MoE, Router, aux_losses, update_expert_biases  # noqa: E402
from titanlite.models.moe_experts import GroupedExperts  # noqa: E402

# torchtitan's debug shapes (the registry's `torchtitan:` flavors), as issue 50 compares them.
DEFAULT_MODELS = (
    "llama3:torchtitan:debugmodel",
    "qwen3:torchtitan:debugmodel_moe",
    "deepseek_v3:torchtitan:debugmodel",
)
PREFIX = "part:"
PARTS = ("attention", "router", "permute+combine", "experts", "shared experts", "dense mlp", "norms", "embedding")
PARTS += ("output head", "loss", "optimizer", "rest")


def part_of(name: str, module: nn.Module) -> str | None:
    """The part a module's forward is charged to; None: its parent's."""
    leaf = name.rsplit(".", 1)[-1]
    kinds = [
        (isinstance(module, (Attention, MLA)), "attention"),
        (isinstance(module, Router), "router"),
        (isinstance(module, GroupedExperts), "experts"),
        (isinstance(module, MoE), "permute+combine"),
        (isinstance(module, FeedForward), "shared experts" if leaf == "shared_experts" else "dense mlp"),
        (leaf in ("attention_norm", "ffn_norm") or name == "norm", "norms"),
        (name == "tok_embeddings", "embedding"),
        (name == "output", "output head"),
    ]
    return next((part for matched, part in kinds if matched), None)


def mark_parts(model: nn.Module) -> None:
    """A `record_function` range named for its part around each part's module forward."""
    for name, module in model.named_modules():
        if (part := part_of(name, module)) is None:
            continue
        ranges: list = []

        def enter(_module, _inputs, part=part, ranges=ranges):
            ranges.append(record_function(PREFIX + part))
            ranges[-1].__enter__()

        def leave(_module, _inputs, _output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    with record_function(PREFIX + "loss"):
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux_losses(model)
    loss.backward()
    with record_function(PREFIX + "optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_biases(model)


def enclosing_part(event) -> str | None:
    """The innermost part range an op ran in."""
    while event is not None:
        if event.name.startswith(PREFIX):
            return event.name[len(PREFIX) :]
        event = event.cpu_parent
    return None


def nested_part_time(event) -> float:
    """The total time of the part ranges directly inside `event` (any depth, not through another part)."""
    inside = 0.0
    for child in event.cpu_children:
        inside += child.cpu_time_total if child.name.startswith(PREFIX) else nested_part_time(child)
    return inside


def breakdown(events) -> dict[tuple[str, str], float]:
    """(part, "fwd" or "bwd") -> microseconds, over the profiled steps."""
    times: dict[tuple[str, str], float] = collections.defaultdict(float)
    part_of_sequence: dict[int, str] = {}
    for event in events:
        if event.name.startswith(PREFIX):
            times[event.name[len(PREFIX) :], "fwd"] += event.cpu_time_total - nested_part_time(event)
        elif event.sequence_nr >= 0 and not event.name.startswith("autograd::engine"):
            part = enclosing_part(event)
            if part is not None:
                part_of_sequence.setdefault(event.sequence_nr, part)
    for event in events:
        if event.name.startswith("autograd::engine::evaluate_function") and event.sequence_nr >= 0:
            times[part_of_sequence.get(event.sequence_nr, "rest"), "bwd"] += event.cpu_time_total
    return times


def measure(family: str, flavor: str, args: argparse.Namespace) -> None:
    spec = get_model_spec(family)
    model_args = spec.args_for(flavor, args.vocab)
    model = spec.model_class(model_args)
    model.init_weights(seed=0)
    mark_parts(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=generator)
        for _ in range(args.warmup_steps + args.steps)
    ]
    walls = []
    for tokens in batches[: args.warmup_steps]:
        started = time.perf_counter()
        train_step(model, optimizer, tokens)
        walls.append(time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for tokens in batches[args.warmup_steps :]:
            train_step(model, optimizer, tokens)
        profiled = (time.perf_counter() - started) / args.steps
    times = breakdown(prof.events())
    step_us = profiled * 1e6
    accounted = sum(times.values())
    times["rest", "fwd"] += max(step_us * args.steps - accounted, 0.0)  # glue and Python between the parts
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\n{family} {flavor}: {params:,} parameters, batch {args.batch} x {args.seq_len}; step "
        f"{statistics.median(walls[1:] or walls) * 1e3:.0f} ms unprofiled, {profiled * 1e3:.0f} ms profiled"
    )
    print(f"  {'part':16s} {'fwd ms':>8s} {'bwd ms':>8s} {'share':>6s}")
    for part in PARTS:
        fwd, bwd = (times.get((part, phase), 0.0) / args.steps / 1e3 for phase in ("fwd", "bwd"))
        if fwd or bwd:
            print(f"  {part:16s} {fwd:8.1f} {bwd:8.1f} {(fwd + bwd) / profiled / 10:5.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096, help="the bundled tokenizer's size by default")
    args = parser.parse_args(argv)
    print(f"one process, float32, eager, {torch.get_num_threads()} threads, {args.steps} profiled steps")
    for entry in args.models.split(","):
        family, flavor = entry.split(":", 1)
        measure(family, flavor, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
