"""Text from a trained model: `python -m titanlite.generate --config NAME --checkpoint DIR --prompt TEXT
[--max-new-tokens N] [--seed S] [--temperature T] [--top-k K] [--section.key value ...]`.

A check of what a run learned, not a server. Why it is built the way it is:

- The model is the trainer's, built by the trainer's code: `build.plan_run` and
  `build_on_meta` + `materialize` at whatever layout the world and `--parallelism.*` give
  (tensor parallel over torchrun processes included), and the weights come through the
  trainer's own initial-load path (`checkpoint.restore.Restorer`: DCP model weights, or a
  Hugging Face folder with `initial_load_format = "hf"`). A second model or loader could
  disagree with what training saved; this one cannot.
- No KV cache: each new token recomputes the whole sequence with the model's one forward,
  up to its `max_seq_len`. Slow for long texts, exact for any layout.
- The input is checked before torch is imported (as `train.py` does), so a bad flag is one
  `titanlite: error:` line and exit code 2 at once; torch-dependent code imports it inside.
- Only rank 0 prints: the text on stdout, its log lines on stderr (`> out.txt` keeps only
  the text). Every rank samples with the same seeded generator and takes rank 0's token, so
  tensor-parallel ranks always feed the same sequence.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from titanlite.config import JobConfig, load_config
from titanlite.errors import OneLineArgumentParser, TitanliteError, report_user_error, say_notices

if TYPE_CHECKING:
    import torch

    from titanlite.build import RunPlan


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Generation's own options, checked; everything else is the config (`--config`, `--section.key`)."""
    parser = OneLineArgumentParser(prog="python -m titanlite.generate", allow_abbrev=False, description=__doc__.split("\n\n")[0],
                     epilog="Config options: python -m titanlite.config --help")  # fmt: skip
    parser.add_argument("--checkpoint", required=True, help="a checkpoint folder (newest complete step-N), one step-N, or a Hugging Face folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add (fewer at max_seq_len or end of text)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (the same on every rank)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; else sample from softmax(logits / T)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens only (0: all)")
    options, config_argv = parser.parse_known_args(argv)
    if not Path(options.checkpoint).is_dir():
        raise TitanliteError(f"--checkpoint: {options.checkpoint} is not a folder")
    if not options.prompt.strip():
        raise TitanliteError("--prompt: empty; give the text to continue")
    if options.max_new_tokens < 1:
        raise TitanliteError(f"--max-new-tokens: must be >= 1 (got {options.max_new_tokens})")
    if options.top_k < 0:
        raise TitanliteError(f"--top-k: must be >= 0, 0 meaning all tokens (got {options.top_k})")
    if not (math.isfinite(options.temperature) and options.temperature >= 0):
        raise TitanliteError(f"--temperature: must be >= 0, 0 meaning greedy (got {options.temperature})")
    return options, config_argv


def is_hf_folder(folder: Path) -> bool:
    """A Hugging Face model folder: config.json beside safetensors weights."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def for_generation(cfg: JobConfig, checkpoint: Path) -> JobConfig:
    """The run's config turned to one forward at a time: the weights come from `checkpoint`
    through the initial-load path (never the run's own resume folder); no compile (every
    step has a new length, each a recompile); causal attention (one prompt is one document)."""
    cfg.checkpoint.enable_checkpoint = False
    cfg.checkpoint.create_seed_checkpoint = False
    cfg.checkpoint.initial_load_path = str(checkpoint)
    cfg.checkpoint.initial_load_format = "hf" if is_hf_folder(checkpoint) else "dcp"
    cfg.compile.enable = False
    cfg.model.attn_mask_type = "causal"
    return cfg


def load_model(cfg: JobConfig, world_size: int, device: torch.device) -> tuple[torch.nn.Module, RunPlan]:
    """(model in eval mode, run plan): built as the trainer builds it, weights loaded by the
    trainer's `Restorer`. `build_model`'s check that the optimizer state fits is skipped:
    generation holds the weights only. Pipeline and context parallel are refused: they split
    the forward across ranks, which this loop does not drive."""
    from titanlite.build import build_on_meta, materialize, plan_run
    from titanlite.checkpoint import integrity, policy
    from titanlite.checkpoint.contents import Contents
    from titanlite.checkpoint.restore import Restorer, check_tokenizer
    from titanlite.parallel.distributed import new_group
    from titanlite.step.precision import resolve_compute_dtype

    plan = plan_run(cfg, world_size)
    for name, degree in (("pipeline_parallel_degree", plan.dims.pp), ("context_parallel_degree", plan.dims.cp)):
        if degree > 1:
            raise TitanliteError(f"parallelism.{name}: generate runs the whole forward on every rank; use 1 (got {degree})")
    checkpoint = Path(cfg.checkpoint.initial_load_path)
    if cfg.checkpoint.initial_load_format == "dcp":  # errors naming --checkpoint, not the config key
        path, record = policy.resolve_initial_load(checkpoint, "--checkpoint")
        if record is not None:  # as a resume checks: another tokenizer would decode garbage, silently
            check_tokenizer(path, record, integrity.tokenizer_record(plan.tokenizer))
    plan = plan.with_compute_dtype(resolve_compute_dtype(cfg.training.mixed_precision_param, device).name)
    meshes = plan.dims.build_mesh(device.type)
    model = build_on_meta(plan, meshes)
    materialize(model, plan, device)
    group = new_group(backend="gloo", group_desc="checkpoint")  # DCP on a CPU group, as the Checkpointer does
    contents = Contents(model, None, None, None, None)
    Restorer(plan.cfg.checkpoint, checkpoint, plan.spec, cfg.model.flavor, plan.model_args, contents, group).load()
    return model.eval(), plan


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / temperature) over the top k
    (all when k is 0), on the CPU with `generator`, so every device and layout draws alike."""
    import torch

    logits = logits.float().cpu()
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def generate_ids(model: torch.nn.Module, prompt: list[int], options: argparse.Namespace, plan: RunPlan,
                 device: torch.device) -> list[int]:
    """The prompt's ids and up to `max_new_tokens` more, stopping early at the end-of-text
    token or at `max_seq_len`. The sequence is right-padded to a multiple of the sequence
    shards (sequence parallel splits it evenly); causal attention keeps padding unseen."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from titanlite.config.dtypes import DTYPES

    shards = getattr(model, "sequence_shards", 1)
    max_len = getattr(plan.model_args, "max_seq_len", None) or (len(prompt) + options.max_new_tokens)
    max_len -= max_len % shards
    if len(prompt) >= max_len:
        raise TitanliteError(f"--prompt: {len(prompt)} tokens leave no room below the model's max_seq_len {max_len}")
    dtype = DTYPES[plan.cfg.training.mixed_precision_param]  # autocast where FSDP does not cast, as the trainer does
    autocast = not plan.dims.fsdp_enabled and dtype != torch.float32
    generator = torch.Generator().manual_seed(options.seed)
    ids = list(prompt)
    with torch.no_grad(), (torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext()):
        while len(ids) < min(len(prompt) + options.max_new_tokens, max_len):
            tokens = torch.tensor([ids + [0] * (-len(ids) % shards)], device=device)
            logits = model(tokens)[0, len(ids) - 1]
            if isinstance(logits, DTensor):  # vocab-sharded under loss parallel
                logits = logits.full_tensor()
            chosen = torch.tensor([next_token(logits, options.temperature, options.top_k, generator)], device=device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(chosen, src=0)
            if int(chosen) == plan.tokenizer.eos_id:
                break
            ids.append(int(chosen))
    return ids


def run(cfg: JobConfig, options: argparse.Namespace) -> int:
    """Join the process group, load, generate, print on rank 0; a user error is one line."""
    from titanlite.logging import init_logger, logger
    from titanlite.parallel.distributed import init_distributed, shutdown
    from titanlite.runtime.preemption import die_with_launcher

    die_with_launcher()
    info = init_distributed(cfg.comm.init_timeout_seconds)
    init_logger(info.rank)
    logger.handlers[0].setStream(sys.stderr)  # stdout holds the text alone
    try:
        model, plan = load_model(cfg, info.world_size, info.device)
        prompt = plan.tokenizer.encode(options.prompt, bos=True, eos=False)
        ids = generate_ids(model, prompt, options, plan, info.device)
        if info.rank == 0:
            print(plan.tokenizer.decode(ids), flush=True)
        return 0
    except TitanliteError as error:
        return report_user_error(error)
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    notices: list[str] = []
    try:
        options, config_argv = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = for_generation(load_config(config_argv, notices), Path(options.checkpoint))
    except TitanliteError as error:
        return report_user_error(error)
    say_notices(notices)
    return run(cfg, options)


if __name__ == "__main__":
    sys.exit(main())
