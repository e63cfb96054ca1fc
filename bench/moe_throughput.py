"""Training throughput of the MoE debug models (Qwen3-MoE's, DeepSeek-V3's, gpt-oss's) each beside a
dense model of its family with the same active parameters, one process, same settings, in one run.

    python bench/moe_throughput.py [--steps 10] [--warmup-steps 3] [--seq-len 512] [--batch 4]
                                   [--vocab 4096] [--threads N]

The MoE model is the `debugmodel_moe` flavor (8 experts of width 256, top 2, with its expert
bias and aux loss). The dense one is the `debugmodel` flavor with the SwiGLU width a token
of the MoE model multiplies by, top_k x 256 = 512 instead of 768: the same matmul weights per
token but the router's (dim x 8 per block, 0.5% of a block's feed-forward). Each trains
`--warmup-steps` + `--steps` steps of a plain loop on random tokens (forward, cross-entropy
plus the MoE aux loss, backward, fused AdamW, the expert-bias update): the model's own cost,
not the trainer's. Printed: active and total parameters, tokens/s and achieved model FLOP/s
(the registry's FLOPs per token, PaLM's accounting on active parameters), and the ratio MoE /
dense. On CPU the experts run as a loop (models/moe_experts.py): routing, sorting and the
per-expert matmuls of smaller groups are what the ratio prices. gpt-oss has no dense blocks: its peer
is one expert of width top_k x 256 that every token takes (its attention, sinks and windows the same
in both). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from titanlite.model_spec import active_parameters  # noqa: E402
from titanlite.models import get_model_spec  # noqa: E402
from titanlite.models.moe import aux_losses, update_expert_biases  # noqa: E402


def models(vocab: int) -> dict[str, tuple[str, object]]:
    """name -> (family, args), in pairs to compare: each MoE debug flavor, then its dense peer
    of the same active parameters."""
    qwen3 = get_model_spec("qwen3")
    moe = qwen3.args_for("debugmodel_moe", vocab)
    dense = dataclasses.replace(qwen3.args_for("debugmodel", vocab), hidden_dim=moe.moe.top_k * moe.moe.hidden_dim)
    deepseek = get_model_spec("deepseek_v3").args_for("debugmodel", vocab)
    width = (deepseek.moe.top_k + deepseek.moe.n_shared_experts) * deepseek.moe.hidden_dim
    deepseek_dense = dataclasses.replace(deepseek, moe=None, hidden_dim=width)
    gpt_oss = get_model_spec("gpt_oss").args_for("debugmodel", vocab)
    one = dataclasses.replace(gpt_oss.moe, n_experts=1, top_k=1, hidden_dim=gpt_oss.moe.top_k * gpt_oss.moe.hidden_dim)
    return {
        "qwen3 moe (debugmodel_moe)": ("qwen3", moe),
        f"qwen3 dense (debugmodel, hidden {dense.hidden_dim})": ("qwen3", dense),
        "deepseek_v3 moe (debugmodel)": ("deepseek_v3", deepseek),
        f"deepseek_v3 dense (every block {width} wide)": ("deepseek_v3", deepseek_dense),
        "gpt_oss moe (debugmodel)": ("gpt_oss", gpt_oss),
        f"gpt_oss dense (one expert {one.hidden_dim} wide)": ("gpt_oss", dataclasses.replace(gpt_oss, moe=one)),
    }


def step_seconds(model: torch.nn.Module, vocab: int, batch: int, seq_len: int, steps: int, warmup: int) -> list[float]:
    """Seconds of each measured step of a plain training loop on random tokens (forward,
    cross-entropy plus the MoE aux loss, backward, fused AdamW, the expert-bias update)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(0)
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux_losses(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_biases(model)
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return times


def measure(family: str, args, batch: int, seq_len: int, steps: int, warmup: int) -> tuple[list[float], int, int]:
    """Seconds of each measured step, and (active, total) parameters."""
    model = get_model_spec(family).model_class(args)
    model.init_weights(seed=0)
    times = step_seconds(model, args.vocab_size, batch, seq_len, steps, warmup)
    total = sum(p.numel() for p in model.parameters())
    return times, active_parameters(args, total), total


def loop_arguments(parser: argparse.ArgumentParser) -> None:
    """The plain loop's options, shared by the one-process benches that time it."""
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096, help="the bundled tokenizer's size by default")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"one process, float32, batch {args.batch} x seq {args.seq_len}, {torch.get_num_threads()} threads, "
        f"{args.steps} steps after {args.warmup_steps} warmup"
    )
    rates = {}
    for name, (family, model_args) in models(args.vocab).items():
        times, active, total = measure(family, model_args, args.batch, args.seq_len, args.steps, args.warmup_steps)
        tokens_per_s = args.batch * args.seq_len / statistics.median(times)
        flops = get_model_spec(family).flops_per_token(model_args, total, args.seq_len) * tokens_per_s
        rates.setdefault(family, []).append(tokens_per_s)
        print(
            f"{name:42s} active {active:>11,} of {total:>11,} parameters  {tokens_per_s:>9,.0f} tokens/s  "
            f"{flops / 1e9:7.1f} GFLOP/s (median step {statistics.median(times) * 1e3:.0f} ms)"
        )
    for family, (moe, dense) in rates.items():
        print(f"ratio {family} moe / dense tokens/s: {moe / dense:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
