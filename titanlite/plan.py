"""Dry-run planner: what one rank of a large run holds, and whether it fits, on one CPU.

    python -m titanlite.plan --config llama_70b --world-size 512 --vocab-size 128256
        [--rank R] [--gpu H100 | --device-memory 80GiB] [--materialize] [--section.key value ...]

The config is loaded and validated exactly as the trainer does it (`build.plan_run`: same
one-line errors, exit code 2). On a fake process group this process becomes rank R of the
world; the model is built on the meta device and parallelized by the trainer's own path
(`build.parallelize`: TP plan, activation checkpointing, compile, FSDP). The report gives
this rank's parameters, gradients and AdamW state from its local shards (exact), estimates
of activations and FSDP's gathered buffers (formulas in titanlite/parallel/estimate.py and
docs/planning.md), their total against the device memory, and a verdict. `--materialize`
then allocates and initializes rank R's shards for real and measures the resident memory.
`training.mixed_precision_param = "auto"` is planned as bfloat16, what a GPU run picks.

Exit code: 0 fits, 1 does not fit, 2 a config or argument error.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from titanlite.build import RunPlan, build_on_meta, materialize, plan_run
from titanlite.config import load_config
from titanlite.config.dtypes import torch_dtype
from titanlite.errors import USER_ERROR_EXIT_CODE, OneLineArgumentParser, TitanliteError, say_notices
from titanlite.parallel.estimate import (
    Activations,
    FsdpWorkingSet,
    StateBytes,
    StepShape,
    estimate_activations,
    estimate_fsdp,
    in_flight_microbatches,
    state_bytes,
)
from titanlite.parallel.fake_world import ShardCensus, census, init_fake_world, shard_specs
from titanlite.parallel.memory import (
    DEFAULT_GPU,
    GIB,
    GPU_MEMORY_GIB,
    parse_memory,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

CENSUS_MAX_WORLD = 4096
"""Above this world size the every-rank count (milliseconds a rank) is skipped."""
PLANNED_AUTO_DTYPE = "bfloat16"
"""What `mixed_precision_param = "auto"` becomes on the GPUs a plan is for (step/precision.py)."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The planner's own options; everything else is the config (`--config`, `--section.key`)."""
    parser = OneLineArgumentParser(
        prog="python -m titanlite.plan",
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        epilog="Config options: python -m titanlite.config --help",
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks (GPUs) of the planned run")
    parser.add_argument("--rank", type=int, default=0, help="the rank to build (default 0, which holds the most)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size, instead of reading model.tokenizer_path")
    parser.add_argument(
        "--gpu", choices=sorted(GPU_MEMORY_GIB), help=f"device whose memory to plan for (default {DEFAULT_GPU})"
    )
    parser.add_argument("--device-memory", help="memory per device, e.g. 80GiB (overrides --gpu)")
    parser.add_argument(
        "--materialize", action="store_true", help="allocate and initialize this rank's shards, and measure"
    )
    args, config_argv = parser.parse_known_args(argv)
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise TitanliteError(f"--rank {args.rank} is not a rank of --world-size {args.world_size}")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise TitanliteError(f"--vocab-size: must be > 0 (got {args.vocab_size})")
    return args, config_argv


def device_memory(args: argparse.Namespace) -> tuple[int, str]:
    """Bytes per device and where the figure comes from."""
    if args.device_memory is not None:
        return parse_memory(args.device_memory), "--device-memory"
    gpu = args.gpu or DEFAULT_GPU
    source = f"--gpu {gpu}" if args.gpu else f"{gpu}, the default; --gpu or --device-memory to change"
    return int(GPU_MEMORY_GIB[gpu] * GIB), source


def plan_config(config_argv: list[str], args: argparse.Namespace) -> tuple[RunPlan, str]:
    """Validate as training does; the vocabulary from --vocab-size or the tokenizer file."""
    notices: list[str] = []
    cfg = load_config(config_argv, notices)
    say_notices(notices)
    try:
        plan = plan_run(cfg, args.world_size, vocab_size=args.vocab_size)
    except TitanliteError as error:
        if str(error).startswith("model.tokenizer_path:"):
            raise TitanliteError(f"{error}; or plan without it: --vocab-size N (128256 for Llama 3)") from None
        raise
    if cfg.training.mixed_precision_param == "auto":
        plan = plan.with_compute_dtype(PLANNED_AUTO_DTYPE)
    source = "--vocab-size" if args.vocab_size is not None else plan.tokenizer.path
    return plan, f"vocab {plan.model_args.vocab_size:,} from {source}"


@dataclass(frozen=True)
class Report:
    """Everything printed about one rank."""

    plan: RunPlan
    args: argparse.Namespace
    vocab_note: str
    coordinate: str
    state: StateBytes
    activations: Activations
    fsdp: FsdpWorkingSet | None
    autocast_copies: int
    device: tuple[int, str]  # bytes per device and where the figure comes from

    @property
    def total(self) -> float:
        held = 0 if self.plan.cpu_offload else self.state.params + self.state.grads + self.state.optimizer
        fsdp = self.fsdp.total if self.fsdp else 0.0
        return held + self.state.buffers + self.activations.total + fsdp + self.autocast_copies


def build_report(
    plan: RunPlan, args: argparse.Namespace, vocab_note: str, model: torch.nn.Module, world: DeviceMesh | None
) -> Report:
    """The figures of this rank's parallelized model (still on meta)."""
    cfg, dims = plan.cfg, plan.dims
    shape = StepShape.from_config(cfg, dims.tp)
    activations = _activations(plan, model, shape, world)
    fsdp = None
    if dims.fsdp_enabled:
        reduce_bytes = torch_dtype(cfg.training.mixed_precision_reduce).itemsize
        fsdp = estimate_fsdp(model, dims.dp_shard, shape.act_bytes, reduce_bytes, cfg.parallelism)
    state = state_bytes(model)
    # Without FSDP, bf16 runs under autocast, which keeps a bf16 copy of each weight per step.
    autocast_copies = state.n_params * shape.act_bytes if not dims.fsdp_enabled and shape.act_bytes < 4 else 0
    names = zip(world.mesh_dim_names, world.get_coordinate()) if world else ()
    coordinate = ", ".join(f"{n} {c}" for n, c in names) or "the only rank"
    return Report(plan, args, vocab_note, coordinate, state, activations, fsdp, autocast_copies, device_memory(args))


def _activations(plan: RunPlan, model: torch.nn.Module, shape: StepShape, world: DeviceMesh | None) -> Activations:
    """The whole model's, or with a pipeline this rank's stages: their blocks (and the head on the
    last stage's rank), one pipeline microbatch each, as many microbatches as the schedule holds
    at its peak."""
    layout = plan.pipeline
    if layout is None:
        return estimate_activations(plan.model_args, shape)
    pp_rank = world.get_coordinate()[world.mesh_dim_names.index("pp")]
    held = layout.stage_indices(pp_rank)
    in_flight = in_flight_microbatches(
        layout.schedule, layout.degree, layout.n_microbatches, layout.stages_per_rank, pp_rank
    )
    microbatch = dataclasses.replace(shape, batch=plan.cfg.parallelism.pipeline_parallel_microbatch_size)
    receives = layout.n_microbatches * sum((index > 0) + (index < len(layout.stages) - 1) for index in held)
    holds_head = len(layout.stages) - 1 in held  # the last stage's rank
    return estimate_activations(plan.model_args, microbatch, len(model.layers), holds_head, in_flight, receives)


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def header(r: Report) -> list[str]:
    cfg, dims = r.plan.cfg, r.plan.dims
    degrees = [f"{name} {size}" for name, size in dims.named_degrees()]
    ac, option = cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option
    if ac == "selective":
        ac += " (per op)" if option == "op" else f" (every {option})"
    return [
        f"model: {cfg.model.name} {r.plan.model_label}, {r.plan.n_params:,} parameters ({r.vocab_note})",
        f"world: {dims.world_size} = {' x '.join(degrees) or '1 process'}"
        + (f", experts split over ep {dims.ep} of them" if dims.ep_enabled else "")
        + f"; rank {r.args.rank} ({r.coordinate})",
        f"step: local_batch_size {cfg.training.local_batch_size} x seq_len {cfg.training.seq_len}, "
        f"{cfg.training.mixed_precision_param} compute, activation checkpointing {ac}"
        + (", loss parallel" if dims.tp_enabled and cfg.parallelism.enable_loss_parallel else "")
        + (f", {cfg.training.seq_len // dims.cp} tokens of each sequence per cp rank" if dims.cp_enabled else "")
        + (", block-causal attention" if cfg.model.attn_mask_type == "block_causal" else ""),
    ] + ([r.plan.pipeline.describe()] if r.plan.pipeline is not None else [])


def holdings(r: Report) -> list[str]:
    """One line per kind of memory; exact ones first, then the estimates and the total."""
    a, s, place = r.activations, r.state, " (host: CPU offload)" if r.plan.cpu_offload else ""
    blocks = (
        f"{a.n_blocks - a.n_checkpointed} blocks x {gib(a.block)} + {a.n_checkpointed} checkpointed x "
        f"{gib(a.checkpointed_block)}, head {gib(a.head)}"
    )
    per_microbatch = f"{a.in_flight} microbatches in flight x ({blocks})" if a.in_flight > 1 else blocks
    activations = (
        f"estimate: {per_microbatch}, peak extra {gib(a.peak_extra)}"
        + (f", pipeline receive buffers {gib(a.buffers)}" if a.buffers else "")
        + (f", all-to-all buffers {gib(a.all_to_all)}" if a.all_to_all else "")
    )
    frozen = f", {s.n_trained:,} trained, {s.n_params - s.n_trained:,} frozen" if s.n_trained < s.n_params else ""
    rows = [
        ("parameters", s.params, f"{s.params:,} bytes: {s.n_params:,} elements of the local shards{frozen}{place}"),
        ("gradients", s.grads, f"{s.grads:,} bytes{place}"),
        ("optimizer", s.optimizer, f"{s.optimizer:,} bytes: AdamW exp_avg and exp_avg_sq{place}"),
        ("buffers", s.buffers, f"{s.buffers:,} bytes"),
        ("activations", a.total, activations),
    ]
    if r.fsdp:
        fsdp = f"estimate: root weights and grads {gib(r.fsdp.root)}, blocks {gib(r.fsdp.blocks)}"
        rows.append(("FSDP gathered", r.fsdp.total, fsdp))
    if r.autocast_copies:
        rows.append(("autocast copies", r.autocast_copies, "estimate: a low-precision copy of each weight"))
    rows.append(("total", r.total, "on the device"))
    return [f"rank {r.args.rank} holds"] + [f"  {name:<16}{gib(size):>14}   {note}" for name, size, note in rows]


def verdict(r: Report) -> list[str]:
    device_bytes, source = r.device
    spare = device_bytes - r.total
    line = f"fits: {gib(r.total)} of {gib(device_bytes)}, {gib(spare)} ({spare / device_bytes:.0%}) to spare"
    if spare < 0:
        line = (
            f"does not fit: {gib(r.total)} needed, {gib(-spare)} more than the device's {gib(device_bytes)}; "
            "add ranks (data_parallel_shard_degree, tensor_parallel_degree), lower training.local_batch_size, "
            "or use activation_checkpoint.mode full"
        )
    return [f"device: {gib(device_bytes)} ({source})", f"verdict: {line}"]


def shard_lines(r: Report, shards: ShardCensus | None) -> list[str]:
    if shards is None:
        world = r.plan.dims.world_size
        reasons = {  # the first that applies
            "one process": world == 1,
            f"not counted above {CENSUS_MAX_WORLD} ranks": world > CENSUS_MAX_WORLD,
            "each pipeline rank holds other stages: plan them with --rank": r.plan.pipeline is not None,
            "not counted (parameters on part of the mesh)": True,
        }
        return [f"shards: {next(why for why, applies in reasons.items() if applies)}"]
    per_rank = shards.per_rank
    most, least = max(per_rank), min(per_rank)
    check = "=" if shards.covered == r.plan.n_params else "!="
    held = f"every rank holds {most:,}"
    if most != least:
        held = f"ranks hold {least:,} (rank {per_rank.index(least)}) to {most:,} (rank {per_rank.index(most)})"
    return [
        f"shards: {held} parameters; summed over all {len(shards.per_rank)} ranks, each replicated tensor once: "
        f"{shards.covered:,} {check} the model's {r.plan.n_params:,}"
    ]


def measured_lines(r: Report, model: torch.nn.Module) -> list[str]:
    """Allocate and initialize this rank's shards on the CPU; the seconds it took and the
    resident memory it grew by, against the estimate."""
    before = rss_bytes()
    reset_peak_rss()
    start, cpu_start = time.perf_counter(), time.process_time()
    materialize(model, r.plan, torch.device("cpu"))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = peak_rss_bytes()
    grown, estimate = peak - before, r.state.params + r.state.buffers
    return [
        f"materialized rank {r.args.rank}: allocated and initialized in {seconds:.1f} s ({cpu_seconds:.1f} s of CPU); "
        f"peak resident memory {gib(peak)}, {gib(grown)} above the {gib(before)} before, against {gib(estimate)} "
        f"estimated for parameters and buffers (ratio {grown / estimate:.2f})"
    ]


def run(argv: list[str]) -> int:
    # One thread: the work is many small tensor ops, which a second OpenMP thread slows
    # down (30x, measured on a busy 2-core host) rather than speeds up.
    torch.set_num_threads(1)
    args, config_argv = parse_args(argv)
    plan, vocab_note = plan_config(config_argv, args)
    init_fake_world(args.world_size, args.rank)
    meshes = plan.dims.build_mesh("cpu")
    model = build_on_meta(plan, meshes)
    report = build_report(plan, args, vocab_note, model, meshes.world)
    measured = measured_lines(report, model) if args.materialize else []
    shards = (
        census(shard_specs(model), meshes.world.mesh_dim_names, tuple(meshes.world.shape), plan.dims.ep)
        if meshes.world is not None and args.world_size <= CENSUS_MAX_WORLD and plan.pipeline is None
        else None
    )
    print("\n".join(header(report) + holdings(report) + verdict(report) + shard_lines(report, shards) + measured))
    return 0 if report.total <= report.device[0] else 1


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except TitanliteError as error:
        print(f"titanlite: error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
