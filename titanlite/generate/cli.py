"""The command line of `python -m titanlite.generate` (the package docstring says why it is
built as it is): generation's own flags and prompts checked, the run's config turned to
decoding, all before torch is imported; then load, decode, print on rank 0."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from titanlite.config import JobConfig, load_config
from titanlite.errors import OneLineArgumentParser, TitanliteError, report_user_error, say_notices


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Generation's own options, checked, with `prompts` the texts to continue; everything
    else is the config (`--config`, `--section.key`)."""
    parser = OneLineArgumentParser(
        prog="python -m titanlite.generate",
        allow_abbrev=False,
        description="Text from a trained model's checkpoint (docs/generate.md).",
        epilog="Config options: python -m titanlite.config --help",
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint folder (newest complete step-N), one step-N, or a Hugging Face folder",
    )
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="a text to continue; repeat it for a batch")
    given.add_argument("--prompt-file", help="a UTF-8 file of texts to continue, one per line (blank lines skipped)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="tokens to add to each text (fewer at max_seq_len or end of text)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of each prompt's sampling generator (the same on every rank)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy; else sample from softmax(logits / T)"
    )
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens only (0: all)")
    parser.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute the whole sequence for every token (slow; the cache's reference)",
    )
    options, config_argv = parser.parse_known_args(argv)
    _check(options)
    options.prompts = read_prompts(options.prompt, options.prompt_file)
    return options, config_argv


def _check(options: argparse.Namespace) -> None:
    """Each option's range, one line naming it."""
    if not Path(options.checkpoint).is_dir():
        raise TitanliteError(f"--checkpoint: {options.checkpoint} is not a folder")
    if options.max_new_tokens < 1:
        raise TitanliteError(f"--max-new-tokens: must be >= 1 (got {options.max_new_tokens})")
    if options.top_k < 0:
        raise TitanliteError(f"--top-k: must be >= 0, 0 meaning all tokens (got {options.top_k})")
    if not (math.isfinite(options.temperature) and options.temperature >= 0):
        raise TitanliteError(f"--temperature: must be >= 0, 0 meaning greedy (got {options.temperature})")


def read_prompts(prompts: list[str] | None, prompt_file: str | None) -> list[str]:
    """The texts to continue: the `--prompt` values, or the non-blank lines of `--prompt-file`."""
    if prompt_file is None:
        if any(not prompt.strip() for prompt in prompts):
            raise TitanliteError("--prompt: empty; give the text to continue")
        return prompts
    try:
        lines = Path(prompt_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise TitanliteError(
            f"--prompt-file: cannot read {prompt_file} ({getattr(error, 'strerror', None) or error})"
        ) from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise TitanliteError(f"--prompt-file: {prompt_file} holds no prompt (one per line)")
    return prompts


def for_generation(cfg: JobConfig, checkpoint: Path) -> JobConfig:
    """The run's config turned to decoding: the weights come from `checkpoint` through the
    initial-load path (never the run's own resume folder); no compile (every step has new
    shapes); the residual stream whole on every TP rank (a step of one token per row cannot
    be split by sequence). Context parallelism is refused: it splits the sequence itself."""
    if cfg.parallelism.context_parallel_degree > 1:
        raise TitanliteError(
            f"parallelism.context_parallel_degree: generate does not split a sequence over ranks; "
            f"use 1 (got {cfg.parallelism.context_parallel_degree})"
        )
    cfg.checkpoint.enable_checkpoint = False
    cfg.checkpoint.create_seed_checkpoint = False
    cfg.checkpoint.initial_load_path = str(checkpoint)
    hf = (checkpoint / "config.json").is_file() and any(checkpoint.glob("*.safetensors"))  # a Hugging Face folder
    cfg.checkpoint.initial_load_format = "hf" if hf else "dcp"
    cfg.compile.enable = False
    cfg.parallelism.sequence_parallel = "off"
    return cfg


def run(cfg: JobConfig, options: argparse.Namespace) -> int:
    """Join the process group, load, decode, print on rank 0; a user error is one line."""
    from titanlite.generate.decode import Sampling, decode
    from titanlite.generate.load import load_model
    from titanlite.generate.stages import StageForward
    from titanlite.logging import init_logger, logger
    from titanlite.parallel.distributed import init_distributed, shutdown
    from titanlite.runtime.preemption import die_with_launcher

    die_with_launcher()
    info = init_distributed(cfg.comm.init_timeout_seconds)
    init_logger(info.rank)
    logger.handlers[0].setStream(sys.stderr)  # stdout holds the texts alone
    try:
        loaded = load_model(cfg, info.world_size, info.device)
        tokenizer = loaded.plan.tokenizer
        rows = decode(
            StageForward(loaded, info.device),
            [tokenizer.encode(text, bos=True, eos=False) for text in options.prompts],
            options.max_new_tokens,
            loaded.plan.model_args.max_seq_len,
            Sampling(options.temperature, options.top_k, options.seed),
            tokenizer.eos_id,
            kv_cache=not options.no_kv_cache,
        )
        if info.rank == 0:
            for ids in rows:
                print(tokenizer.decode(ids), flush=True)
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
