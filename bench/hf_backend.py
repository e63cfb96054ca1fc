"""Training throughput of the any-model backend (`--model.name hf`: transformers' own model run
by titanlite, models/hf/) beside the native family of the same shape, one process, in one run.

    python bench/hf_backend.py [--steps 10] [--warmup-steps 3] [--seq-len 512] [--batch 4]
                               [--vocab 4096] [--threads N] [--rounds 2]

Pairs: Llama's `debugmodel` and Qwen3's `debugmodel_moe` (8 experts of width 256, top 2). The
HF model of each is built from the config.json the family's own Hugging Face adapter writes for
that flavor (so both have the same parameters; the count is printed, and must agree), and the
HF Qwen3-MoE runs titanlite's MoE layer in place of transformers' sparse blocks
(models/hf/moe.py); the native one runs without its flavor's aux loss and expert bias, as
transformers' model trains by default (`output_router_logits` off, no bias). Each model trains
`--warmup-steps` + `--steps` steps of a plain loop on random tokens (forward, cross-entropy
plus the MoE aux loss, backward, fused AdamW; bench/moe_throughput.py's loop): the models' own cost. The
pairs are measured in `--rounds` alternating rounds and each model's best median kept, so a
noisy moment hurts neither side alone. Printed: parameters, tokens/s, and the ratio HF backend
/ native. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from titanlite.models import get_model_spec  # noqa: E402
from titanlite.models.hf import read_hf_args  # noqa: E402
from moe_throughput import loop_arguments, step_seconds  # noqa: E402  (bench/, beside this file)

PAIRS = {"llama": ("llama3", "debugmodel"), "qwen3-moe": ("qwen3", "debugmodel_moe")}


def build_pair(family: str, flavor: str, vocab: int, folder: Path) -> dict[str, torch.nn.Module]:
    """The native model of `flavor` and the HF backend's model of the config.json its adapter writes."""
    spec = get_model_spec(family)
    args = spec.args_for(flavor, vocab)
    if args.moe is not None:  # as transformers' model trains: no aux loss (output_router_logits off), no expert bias
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, aux_loss_coef=0.0, use_expert_bias=False))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(spec.hf_adapter.hf_config(args), indent=2))
    hf_spec = get_model_spec("hf")
    models = {"native": spec.model_class(args), "hf backend": hf_spec.model_class(read_hf_args(str(folder)))}
    for model in models.values():
        model.init_weights(seed=0)
    return models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop_arguments(parser)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"one process, float32, batch {args.batch} x seq {args.seq_len}, {torch.get_num_threads()} threads, "
        f"{args.steps} steps after {args.warmup_steps} warmup, best of {args.rounds} rounds"
    )
    with tempfile.TemporaryDirectory() as root:
        pairs = {name: build_pair(*family, args.vocab, Path(root) / name) for name, family in PAIRS.items()}
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.rounds):
            for name, models in pairs.items():
                for side, model in models.items():
                    times = step_seconds(model, args.vocab, args.batch, args.seq_len, args.steps, args.warmup_steps)
                    seconds = statistics.median(times)
                    best[name, side] = min(best.get((name, side), seconds), seconds)
    tokens = args.batch * args.seq_len
    for name, models in pairs.items():
        for side, model in models.items():
            params = sum(p.numel() for p in model.parameters())
            print(f"{name:10s} {side:11s} {params:>11,} parameters  {tokens / best[name, side]:>9,.0f} tokens/s")
        print(f"ratio {name} hf backend / native tokens/s: {best[name, 'native'] / best[name, 'hf backend']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
