"""Export a DCP checkpoint's model weights as one `torch.save` file (one process, no GPU).

    python scripts/export_checkpoint.py outputs/checkpoint/step-1000 model.pt [--dtype bfloat16]

It writes one `.pt` file (a folder as the output is refused: name the file). For Hugging
Face safetensors + config.json use `scripts/convert_hf.py to-hf` instead.

The input is one step folder (or a checkpoint root: its newest complete step). Only the
model's tensors are read, at their full (unsharded) shapes, whatever mesh saved them; the
file is a plain state dict that loads into an unparallelized model (progress lines say how
far the read got, and a line says when the write starts):

    model = Llama(args); model.init_weights(); model.load_state_dict(torch.load("model.pt"))
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from titanlite.checkpoint import export, policy
from titanlite.config.dtypes import DTYPE_NAMES, torch_dtype
from titanlite.errors import USER_ERROR_EXIT_CODE, TitanliteError
from titanlite.logging import init_logger


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a DCP step folder, or a checkpoint root (its newest complete step)")
    parser.add_argument("out", help="output .pt file")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPE_NAMES), default=None, help="cast floating-point weights (default: as saved)"
    )
    args = parser.parse_args(argv)
    init_logger(0)  # progress lines: reading a large checkpoint takes minutes
    try:
        if Path(args.out).is_dir() or args.out.endswith(("/", os.sep)):
            raise TitanliteError(
                f"out: {args.out} is a folder; name the output file, e.g. {Path(args.out) / 'model.pt'}"
            )
        folder, record = policy.resolve_initial_load(Path(args.checkpoint), "checkpoint")
        n = export.dcp_to_full_file(folder, args.out, torch_dtype(args.dtype) if args.dtype else None)
    except TitanliteError as error:
        print(f"titanlite: error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    size = Path(args.out).stat().st_size
    what = f"step {record.step}" if record else "checkpoint"
    print(f"wrote {args.out}: {n} tensors of {what} from {folder} ({size / 2**20:,.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
