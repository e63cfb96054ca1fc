"""Convert between our checkpoints and Hugging Face weights (Llama, Qwen3, Qwen3-MoE; one process, no GPU).

    # ours -> HF: sharded safetensors + index + config.json, loadable by transformers' from_pretrained
    python scripts/convert_hf.py to-hf outputs/checkpoint/step-1000 hf_out/ [--dtype bfloat16]
    python scripts/convert_hf.py to-hf model.pt hf_out/ --model llama3 --flavor 8B --vocab-size 128256

    # HF -> ours: a DCP folder usable as checkpoint.initial_load_path (format dcp), or a .pt file
    python scripts/convert_hf.py from-hf hf_model/ seed_ckpt/ [--model llama3] [--flavor 8B]
    python scripts/convert_hf.py from-hf Qwen3-30B-A3B/ seed_ckpt/ --flavor 30B-A3B

Our checkpoints say which model they hold (commit.json); a bare .pt file does not, so
to-hf then needs --model/--flavor/--vocab-size, and every tensor's shape must be the
flavor's (the config.json it writes), or one line names the first that is not. from-hf
takes the model from config.json's `model_type` (--model, when given, must read it), the
hyperparameters from config.json, RoPE included wherever its transformers version wrote it
(`rope_parameters`, or top-level `rope_theta` / `rope_scaling`); --flavor only names the
result (it must match config.json). Both say how far their reads and writes got. Loading HF
weights straight into training needs no conversion: checkpoint.initial_load_format = "hf",
which checks config.json against the flavor the same way.
Both directions run on titanlite.checkpoint.hf_io, the code a multi-process run uses (DCP's
Hugging Face storage reader and writer), here on one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint import commit, export, hf_io, policy
from titanlite.config.dtypes import DTYPE_NAMES, torch_dtype
from titanlite.checkpoint.load_progress import ProgressWriter
from titanlite.errors import USER_ERROR_EXIT_CODE, TitanliteError
from titanlite.logging import init_logger
from titanlite.models import get_model_spec, model_names
from titanlite.model_spec import ModelSpec


def args_from_record(record: commit.CommitRecord) -> tuple[ModelSpec, Any]:
    """(ModelSpec, model args) of a checkpoint, rebuilt from its commit record: the
    flavor's args with the recorded hyperparameters (vocab size included) put back. A model
    converted from Hugging Face without --flavor is recorded as flavor "hf": every hyperparameter
    is in its record, so any flavor serves as the base."""
    spec = get_model_spec(record.fingerprint["name"])
    base = spec.flavors.get(record.fingerprint["flavor"]) or next(iter(spec.flavors.values()))
    return spec, _rebuilt(base, record.model_args, list(spec.flavors.values()))


def _rebuilt(base: Any, recorded: dict[str, Any], flavors: list[Any]) -> Any:
    """`base` (a hyperparameter dataclass) with the recorded values put back: lists as the
    tuples they were, and a nested dataclass (an MoE layer's args, recorded as a dict) as
    its own type, whether `base` has one there or None (a flavor that has one serves as
    the pattern)."""
    values = {}
    for field in dataclasses.fields(base):
        if field.name not in recorded:
            continue
        value = recorded[field.name]
        if isinstance(value, dict):
            pattern = next(
                (p for p in (getattr(f, field.name) for f in [base, *flavors]) if dataclasses.is_dataclass(p)), None
            )
            if pattern is None:
                raise TitanliteError(f"the checkpoint records {field.name} = {value}, which no flavor of the model has")
            value = _rebuilt(pattern, value, [])
        values[field.name] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(base, **values)


def _adapter(spec: ModelSpec) -> Any:
    if spec.hf_adapter is not None:
        return spec.hf_adapter
    raise TitanliteError(f"--model: {spec.name} has no Hugging Face mapping")


def check_shapes(source: Path, state: dict[str, torch.Tensor], wanted: dict[str, tuple[int, ...]], what: str) -> None:
    """Every tensor of `state` is one of the model's, at the shape `what` (the model, flavor
    and vocabulary whose config.json is written beside them) has: else transformers would
    build that model around tensors of another."""
    for key, shape in wanted.items():
        if key not in state:
            raise TitanliteError(f"{source}: tensor {key} of {what} is missing")
        if tuple(state[key].shape) != shape:
            raise TitanliteError(
                f"{source}: tensor {key} has shape {list(state[key].shape)}, but {what} has {list(shape)}"
            )
    unknown = sorted(set(state) - set(wanted))
    if unknown:
        raise TitanliteError(f"{source}: tensor {unknown[0]} is not part of {what}")


def to_hf(args: argparse.Namespace) -> str:
    source = Path(args.source)
    dtype = torch_dtype(args.dtype) if args.dtype else None
    if source.suffix == ".pt":
        if not (args.flavor and args.vocab_size):
            raise TitanliteError(
                f"{source}: a .pt file does not say which model it holds: pass --flavor and --vocab-size"
            )
        spec = get_model_spec(args.model or "llama3", args.flavor)
        model_args = spec.args_for(args.flavor, args.vocab_size)
        what = f"--model {spec.name} --flavor {args.flavor} --vocab-size {args.vocab_size}"
        state = torch.load(source, map_location="cpu", weights_only=True)
    else:
        folder, record = policy.resolve_initial_load(source, "source")
        if record is None:
            raise TitanliteError(
                f"{folder}: no commit.json, so the model is unknown; export it to .pt first and pass --flavor"
            )
        spec, model_args = args_from_record(record)
        what = f"the model its commit.json records ({spec.name} {record.fingerprint['flavor']})"
        state = export.read_dcp_model(folder)
    check_shapes(source, state, hf_io.whole_model_shapes(spec.model_class, model_args), what)
    out = hf_io.save_hf_weights(
        state, args.out, _adapter(spec), model_args, dtype=dtype, max_file_bytes=args.max_shard_size
    )
    files = len(list(out.glob("*.safetensors")))
    return (
        f"wrote {out} ({len(state)} tensors in {files} safetensors file{'s' if files != 1 else ''} + "
        f"{hf_io.HF_CONFIG_FILE}, {spec.name} {model_args.dim}d x {model_args.n_layers})"
    )


def model_for(config: dict[str, Any], path: Path, name: str | None) -> str:
    """The registered model that reads config.json's `model_type`: `name` when given (it must
    read it), else the one whose Hugging Face adapter lists it."""
    model_type = config.get("model_type")
    readers = {
        model: adapter.HF_MODEL_TYPES
        for model in model_names()
        if (adapter := get_model_spec(model).hf_adapter) is not None
    }
    match = next((model for model, types in readers.items() if model_type in types), None)
    if name is None and match is None:
        known = ", ".join(repr(t) for types in readers.values() for t in types)
        raise TitanliteError(f"{path}: model_type {model_type!r} is not one titanlite converts ({known})")
    if name is not None and model_type not in readers.get(name, ()):
        hint = f"; pass --model {match}" if match else ""
        raise TitanliteError(f"--model: {name} does not read {path}: its model_type is {model_type!r}{hint}")
    return name or match


def from_hf(args: argparse.Namespace) -> str:
    config = hf_io.read_hf_config(args.source)
    spec = get_model_spec(model_for(config, Path(args.source) / hf_io.HF_CONFIG_FILE, args.model), args.flavor)
    adapter = _adapter(spec)
    try:
        base = spec.flavors[args.flavor] if args.flavor else None
        model_args = adapter.args_from_hf_config(config, base)
    except (KeyError, ValueError) as error:
        raise TitanliteError(f"{Path(args.source) / hf_io.HF_CONFIG_FILE}: {error}") from None
    if args.flavor:
        expected = spec.args_for(args.flavor, model_args.vocab_size)
        wrong = adapter.check_hf_config(config, expected)
        if wrong:
            raise TitanliteError(
                f"--flavor: {args.flavor} does not match {Path(args.source) / hf_io.HF_CONFIG_FILE}: {', '.join(wrong)}"
            )
        model_args = expected
    state = hf_io.read_hf_model(args.source, adapter, model_args, spec.model_class)
    state = export.cast_floating(state, torch_dtype(args.dtype) if args.dtype else None)
    out = Path(args.out)
    if out.suffix == ".pt":
        export.save_full_file(state, out)
        return f"wrote {out} ({len(state)} tensors)"
    with export.single_process():
        dcp.save({"model": state}, storage_writer=ProgressWriter(out), no_dist=True)
    fingerprint = commit.fingerprint(spec.name, args.flavor or "hf", model_args)
    record = commit.CommitRecord(
        step=0,
        fingerprint=fingerprint,
        contents=["model"],
        model_weights_only=True,
        export_dtype=args.dtype,
        model_args=commit.args_dict(model_args),
    )
    commit.write_commit(out, record)
    return f"wrote DCP checkpoint {out} ({len(state)} tensors); use it as checkpoint.initial_load_path"


def _byte_size(text: str) -> int:
    units = {"KB": 1024, "MB": 1024**2, "GB": 1024**3}
    unit = next((u for u in units if text.upper().endswith(u)), None)
    try:
        value = int(float(text[: -len(unit)]) * units[unit]) if unit else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 1000000)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("to-hf", help="our DCP step folder (or .pt export) -> Hugging Face folder")
    out.add_argument("source")
    out.add_argument("out")
    back = sub.add_parser("from-hf", help="Hugging Face folder -> our DCP folder (or .pt file)")
    back.add_argument("source")
    back.add_argument("out")
    out.add_argument("--model", default=None, help="registered model name, with a .pt source (default llama3)")
    back.add_argument("--model", default=None, help="registered model name (default: from config.json's model_type)")
    for p in (out, back):
        p.add_argument("--flavor", default=None)
        p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="cast floating-point weights")
    out.add_argument("--vocab-size", type=int, default=None, help="with a .pt source")
    out.add_argument(
        "--max-shard-size",
        type=_byte_size,
        default=hf_io.DEFAULT_MAX_FILE_BYTES,
        help="largest safetensors file, as transformers' max_shard_size: bytes, or with KB/MB/GB (default 5GB)",
    )
    args = parser.parse_args(argv)
    init_logger(0)  # progress lines: reading and writing a large model takes minutes
    try:
        print(to_hf(args) if args.command == "to-hf" else from_hf(args))
    except TitanliteError as error:
        print(f"titanlite: error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
