"""Where a training step's time goes, by part of the model, in titanlite and in torchtitan on
the same shape: attention, the MoE router, the token permutation and combine, the routed
experts, the shared experts, the dense MLPs, the norms, the embedding and the head, each
forward and backward; the loss, the optimizer, and the rest (block glue: residual adds, the
RoPE table lookup, the autograd engine, Python). Then the parts and the aten ops where
titanlite spends more than torchtitan.

    python bench/step_breakdown.py [--models family:flavor,...] [--steps 4] [--warmup-steps 2]
                                   [--seq-len 256] [--batch 4] [--vocab 4096]
                                   [--torchtitan-python /work/tt-venv/bin/python | --torchtitan-python none]

One process, float32, eager, a plain loop on random tokens (forward, cross-entropy plus the
MoE aux loss, backward, fused AdamW, the expert-bias update), as bench/moe_throughput.py:
`--warmup-steps`, then `--steps` timed (the unprofiled step, their median), then `--steps` profiled.
torchtitan's side (its own llama3, qwen3 and deepseek_v3 modules of torchtitan 0.2.2, the
same flavor at the same vocabulary; its expert-bias rule as its optimizer hook applies it)
runs the same loop in a subprocess under torchtitan's venv (set up as bench/torchtitan_baseline.py
says; bench/torchtitan_shim.py's patches make it import on a CPU host), one model after
titanlite's. Method: the measured steps run under torch.profiler (CPU activity). Forward
hooks open a `record_function` range around each part's module, found by the names both
frameworks give them (`attention`, `router`, `experts`, `shared_experts`, `feed_forward` or
`moe`, the norms, `tok_embeddings`, `output`): the MoE layer's own range less the ranges of
its router, experts and shared experts inside it is the permutation and combine (sort, gather,
the weighted sum). Each backward op (autograd's `evaluate_function` event) is charged to the
part whose range ran the forward op of the same autograd sequence number; the gradient
accumulation of the leaves and backward ops of forward ops outside any part go to "rest".
Shares are of the profiled step (the profiler's own overhead included); the unprofiled wall
time per step is printed beside them, and torchtitan's unprofiled step over titanlite's (speed). Nothing is asserted.

Why: issue 50 asks where a DeepSeek-V3 step's time goes against Llama's and Qwen3-MoE's, and
where titanlite spends more than torchtitan's same step. FSDP 2 against ep 2 by the same parts
(plus the all-to-all and FSDP's collectives) is bench/moe_ep.py's; torchtitan's whole trainer
beside titanlite's, per layout, is bench/torchtitan_baseline.py's.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere
sys.path.insert(0, str(REPO / "bench"))  # the torchtitan shim's patches

# torchtitan's debug shapes (titanlite's `torchtitan:` flavors, the same family and flavor names in
# torchtitan), as issue 50 compares them.
DEFAULT_MODELS = (
    "llama3:torchtitan:debugmodel",
    "qwen3:torchtitan:debugmodel_moe",
    "deepseek_v3:torchtitan:debugmodel",
)
TORCHTITAN_PYTHON = "/work/tt-venv/bin/python"
PREFIX = "part:"
PARTS = ("attention", "router", "permute+combine", "experts", "shared experts", "dense mlp", "norms", "embedding")
PARTS += ("output head", "loss", "optimizer", "rest")
NAMED_PARTS = {
    "attention": "attention",
    "router": "router",
    "experts": "experts",
    "shared_experts": "shared experts",
    "reorderer": "permute+combine",
    "attention_norm": "norms",
    "ffn_norm": "norms",
    "tok_embeddings": "embedding",
    "output": "output head",
}


def part_of(name: str, module: nn.Module) -> str | None:
    """The part a module's forward is charged to (None: its parent's), by the names titanlite
    and torchtitan both give their modules: a block's MLP is `feed_forward` (titanlite, dense
    or MoE) or `moe` (torchtitan); an MoE layer is the one with a `router`."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("feed_forward", "moe"):
        return "permute+combine" if hasattr(module, "router") else "dense mlp"
    return "norms" if name == "norm" else NAMED_PARTS.get(leaf)


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


def titanlite_model(entry: str, vocab: int) -> tuple[nn.Module, Callable[[], torch.Tensor], Callable[[], None]]:
    """titanlite's model of `entry` (family:flavor), its aux loss and its expert-bias update."""
    from titanlite.models import get_model_spec
    from titanlite.models.moe import aux_losses, update_expert_biases

    family, flavor = entry.split(":", 1)
    spec = get_model_spec(family)
    model = spec.model_class(spec.args_for(flavor, vocab))
    model.init_weights(seed=0)
    return model, lambda: aux_losses(model), lambda: update_expert_biases(model)


def torchtitan_model(entry: str, vocab: int) -> tuple[nn.Module, Callable[[], torch.Tensor], Callable[[], None]]:
    """torchtitan's own model of the same flavor (`torchtitan:<name>` in titanlite's registry)
    at `vocab`, and its expert-bias rule (components/optimizer.py's step pre-hook, one process:
    bias += coeff * sign(mean - count), centered; counts zeroed). torchtitan has no aux loss on
    these flavors."""
    import torchtitan_shim

    torchtitan_shim.stub_moe_kernels()
    torchtitan_shim.import_torchtitan_on_cpu()
    torchtitan_shim.integer_histc_on_cpu()
    import importlib

    family, _, flavor = entry.split(":", 2)
    package = importlib.import_module(f"torchtitan.models.{family}")
    spec = package.get_train_spec()
    args = dataclasses.replace(spec.model_args[flavor], vocab_size=vocab)
    if hasattr(args, "moe_args"):  # what update_from_config decides on a CPU host
        args.moe_args.use_grouped_mm = False
        args.moe_impl = "standard"
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    moes = [block.moe for block in model.layers.values() if getattr(block, "moe_enabled", False)]

    @torch.no_grad()
    def update_biases() -> None:
        for moe in moes:
            if moe.load_balance_coeff is None or moe.expert_bias is None:
                continue
            counts = moe.tokens_per_expert.float()
            delta = moe.load_balance_coeff * torch.sign(counts.mean() - counts)
            moe.expert_bias.add_(delta - delta.mean())
            moe.tokens_per_expert.zero_()

    return model, lambda: torch.zeros(()), update_biases


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


def measure(framework: str, entry: str, args: argparse.Namespace) -> dict:
    """One model's step in `framework`: parameters, unprofiled and profiled ms per step, each
    part's forward and backward ms per step, and each aten op's self ms per step."""
    build = titanlite_model if framework == "titanlite" else torchtitan_model
    model, aux_loss, update_biases = build(entry, args.vocab)
    mark_parts(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=generator)
        for _ in range(args.warmup_steps + 2 * args.steps)
    ]

    def train_step(tokens: torch.Tensor) -> None:
        logits = model(tokens[:, :-1])
        with record_function(PREFIX + "loss"):
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux_loss()
        loss.backward()
        with record_function(PREFIX + "optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update_biases()

    timed = args.warmup_steps + args.steps
    walls = []  # seconds of each unprofiled step after the warm-up
    for index, tokens in enumerate(batches[:timed]):
        started = time.perf_counter()
        train_step(tokens)
        if index >= args.warmup_steps:
            walls.append(time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for tokens in batches[timed:]:
            train_step(tokens)
        profiled = (time.perf_counter() - started) / args.steps
    times = breakdown(prof.events())
    accounted = sum(times.values())
    times["rest", "fwd"] += max(profiled * 1e6 * args.steps - accounted, 0.0)  # glue and Python between the parts
    per_step_ms = 1e3 * args.steps
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "unprofiled_ms": statistics.median(walls) * 1e3,
        "profiled_ms": profiled * 1e3,
        "parts": {part: [times.get((part, phase), 0.0) / per_step_ms for phase in ("fwd", "bwd")] for part in PARTS},
        "ops": {e.key: e.self_cpu_time_total / per_step_ms for e in prof.key_averages() if e.key.startswith("aten::")},
    }


def torchtitan_figures(entry: str, args: argparse.Namespace) -> dict | None:
    """One model's figures from torchtitan's venv (this script, `--framework torchtitan`)."""
    if args.torchtitan_python == "none" or not Path(args.torchtitan_python).exists():
        return None
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "torchtitan.json"
        cmd = [args.torchtitan_python, __file__, "--framework", "torchtitan", "--json", str(out), "--models", entry]
        cmd += args.forwarded
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"torchtitan's side failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())[entry]


def report(entry: str, mine: dict, theirs: dict | None, args: argparse.Namespace) -> None:
    """One model's parts, titanlite beside torchtitan, and where titanlite spends more."""
    print(
        f"\n{entry}: {mine['parameters']:,} parameters, batch {args.batch} x {args.seq_len}; titanlite step "
        f"{mine['unprofiled_ms']:.0f} ms unprofiled, {mine['profiled_ms']:.0f} ms profiled"
        + (
            f"; torchtitan {theirs['parameters']:,} parameters, {theirs['unprofiled_ms']:.0f} / "
            f"{theirs['profiled_ms']:.0f} ms (titanlite's speed / torchtitan's, unprofiled: "
            f"{theirs['unprofiled_ms'] / mine['unprofiled_ms']:.2f})"
            if theirs
            else ""
        )
    )
    print(
        f"  {'part':16s} {'fwd ms':>8s} {'bwd ms':>8s} {'share':>6s}"
        + ("  torchtitan fwd / bwd ms  share" * bool(theirs))
    )
    for part in PARTS:
        fwd, bwd = mine["parts"][part]
        tt_fwd, tt_bwd = theirs["parts"][part] if theirs else (0.0, 0.0)
        if fwd or bwd or tt_fwd or tt_bwd:
            line = f"  {part:16s} {fwd:8.1f} {bwd:8.1f} {(fwd + bwd) / mine['profiled_ms'] * 100:5.1f}%"
            if theirs:
                line += f"  {tt_fwd:14.1f} / {tt_bwd:6.1f}  {(tt_fwd + tt_bwd) / theirs['profiled_ms'] * 100:5.1f}%"
            print(line)
    if not theirs:
        return
    step = theirs["profiled_ms"]
    more = [(sum(mine["parts"][p]) - sum(theirs["parts"][p]), p) for p in PARTS]
    more = [f"{p} +{d:.1f} ms" for d, p in sorted(more, reverse=True) if d > 0.01 * step]
    print(f"  titanlite spends more than torchtitan (over 1% of its step): {', '.join(more) or 'nowhere'}")
    ops = set(mine["ops"]) | set(theirs["ops"])
    diffs = sorted(((mine["ops"].get(op, 0.0) - theirs["ops"].get(op, 0.0), op) for op in ops), reverse=True)
    print("  aten ops, self ms per step, titanlite - torchtitan: " + ", ".join(f"{op} {d:+.1f}" for d, op in diffs[:4]))
    print("    ... and the other way: " + ", ".join(f"{op} {d:+.1f}" for d, op in diffs[::-1][:4]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096, help="the bundled tokenizer's size by default")
    parser.add_argument("--torchtitan-python", default=TORCHTITAN_PYTHON, help="torchtitan's venv python, or none")
    parser.add_argument("--framework", choices=("titanlite", "torchtitan"), default="titanlite", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)  # where the torchtitan side writes its figures
    args = parser.parse_args(argv)
    names = ("steps", "warmup_steps", "seq_len", "batch", "vocab")
    args.forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names]
    entries = args.models.split(",")
    if args.framework == "torchtitan":
        Path(args.json).write_text(json.dumps({entry: measure("torchtitan", entry, args) for entry in entries}))
        return 0
    print(f"one process, float32, eager, {torch.get_num_threads()} threads, {args.steps} profiled steps")
    if args.torchtitan_python != "none" and not Path(args.torchtitan_python).exists():
        print(f"(no torchtitan venv at {args.torchtitan_python}: titanlite only; see bench/torchtitan_baseline.py)")
    for entry in entries:  # each model in titanlite, then at once in torchtitan
        report(entry, measure("titanlite", entry, args), torchtitan_figures(entry, args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
