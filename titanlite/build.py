"""From a validated config to a parallelized, initialized model, shared by the trainer and
the dry-run planner (`titanlite.plan`), so both build exactly the same thing.

`plan_run` resolves everything that needs only the config and the world size (model spec,
tokenizer vocabulary, mesh degrees, batch split, pipeline stages) and raises every user error
before a device is touched. `build_model` then builds on meta, splits the model into this
rank's pipeline stages (when pp > 1), applies the parallelisms to each in their fixed order
(`parallelize`, in the order docs/parallelism.md gives) and materializes this rank's shards.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from titanlite.config import JobConfig
from titanlite.config.dtypes import DTYPES
from titanlite.config.param_groups import check_matched
from titanlite.data.tokenizers import Tokenizer, tokenizer_file
from titanlite.errors import TitanliteError
from titanlite.models import get_model_spec, moe
from titanlite.models.init import init_adapters
from titanlite.parallel.expert_tensor_parallel import refuse_unsplittable
from titanlite.parallel.lora import convert as lora_adapters
from titanlite.model_spec import HF_CONFIG_FILE, read_hf_config, Capability, DecoderArgs, ModelSpec
from titanlite.parallel import parallelize as parallel
from titanlite.parallel.activation_checkpoint import ac_setting
from titanlite.parallel.memory import check_training_state_fits
from titanlite.parallel.mesh import Meshes, ParallelDims
from titanlite.parallel.pipeline import ModelParts, shared_parameters, split_stage
from titanlite.parallel.pipeline_plan import PipelineLayout, part_flops, plan_layout
from titanlite.parallel.tensor_parallel import sequence_parallel_for
from titanlite.parallel.units import select


@dataclass(frozen=True)
class RunPlan:
    """Everything derived from the config and the world size, checked before any device use."""

    cfg: JobConfig
    spec: ModelSpec
    model_args: DecoderArgs
    tokenizer: Tokenizer | None  # None when planned from a given vocab_size
    dims: ParallelDims
    grad_accum_steps: int
    n_params: int  # the whole model's, the same at every layout (a DTensor's numel is the global one)
    pipeline: PipelineLayout | None = None  # the stages when pipeline_parallel_degree > 1

    @property
    def model_label(self) -> str:
        return model_label(self.spec, self.cfg.model)

    @property
    def float8(self) -> Any:
        """The `[float8]` section when `model.converters` names float8, else None."""
        return self.cfg.float8 if "float8" in self.cfg.model.converters else None

    @property
    def lora(self) -> Any:
        """The `[lora]` section when `model.converters` names lora, else None."""
        return self.cfg.lora if "lora" in self.cfg.model.converters else None

    @property
    def precomputes_float8_scales(self) -> bool:
        """Whether each step starts by computing the float8 all-gathers' weight scales in one
        all-reduce (precompute_float8_dynamic_scale_for_fsdp, where FSDP gathers float8: the
        config allows it only with enable_fsdp_float8_all_gather)."""
        return (
            self.float8 is not None and self.dims.fsdp_enabled and self.float8.precompute_float8_dynamic_scale_for_fsdp
        )

    @property
    def cpu_offload(self) -> bool:
        """Whether FSDP keeps this rank's shards, gradients and optimizer state in host memory."""
        return self.dims.fsdp_enabled and self.cfg.training.enable_cpu_offload

    def with_compute_dtype(self, name: str) -> RunPlan:
        """This plan with `training.mixed_precision_param` made concrete: "auto" is decided
        per device (`step/precision.py`, by the trainer; the planner takes bfloat16, a GPU's)
        before anything is built."""
        return self._with_setting("training", mixed_precision_param=name)

    def with_dump_folder(self, folder: str) -> RunPlan:
        """This plan writing under `folder` (a fault-tolerant replica group's own): every consumer
        (run lock, metrics, checkpoints, traces) reads the plan's config."""
        return self._with_setting("job", dump_folder=folder)

    def _with_setting(self, section: str, **values: Any) -> RunPlan:
        """A new plan and config with `values` in `section`: no config is edited after load."""
        changed = dataclasses.replace(getattr(self.cfg, section), **values)
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, **{section: changed}))


def plan_run(cfg: JobConfig, world_size: int, vocab_size: int | None = None) -> RunPlan:
    """Resolve the model, mesh degrees and batch split; every user error surfaces here.

    `vocab_size` stands in for the tokenizer's, which is then not read: the dry-run
    planner sizes a model whose tokenizer file is not on this machine.
    """
    spec = get_model_spec(cfg.model.name, cfg.model.flavor)
    check_capabilities(spec, cfg)
    tokenizer = (
        Tokenizer(tokenizer_file(cfg.model.tokenizer_path, cfg.model.hf_assets_path)) if vocab_size is None else None
    )
    args = model_args(spec, cfg.model, tokenizer.vocab_size if tokenizer else vocab_size)
    if cfg.checkpoint.last_save_in_hf and (problems := spec.hf_adapter.hf_export_problems(args)):
        raise TitanliteError(
            f"checkpoint.last_save_in_hf: model {spec.name} {model_label(spec, cfg.model)} has what Hugging Face's "
            f"class cannot hold: {', '.join(problems)}"
        )
    if spec.supports("document_mask"):
        args = dataclasses.replace(args, attn_mask_type=cfg.model.attn_mask_type)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    dims.check_model(spec.tp_problems(args, dims.tp), cfg.training.seq_len)
    model = _whole_model_on_meta(spec, args, cfg)
    check_matched(cfg.optimizer.param_groups, [name for name, _ in model.named_parameters()])
    if dims.ep_enabled or dims.etp_enabled:
        layers = moe.moe_layers(model).values()
        dims.check_experts([layer.args.n_experts for layer in layers], f"model {spec.name} flavor {cfg.model.flavor}")
        for layer in layers if dims.etp_enabled else []:
            refuse_unsplittable(layer.experts)
    reshard = cfg.parallelism.fsdp_reshard_after_forward
    if reshard.isdigit() and (not dims.fsdp_enabled or (dims.dp_shard * dims.cp) % int(reshard)):
        raise TitanliteError(
            f"parallelism.fsdp_reshard_after_forward: {reshard} ranks do not divide the FSDP shards "
            f"(data_parallel_shard_degree x context_parallel_degree = {dims.dp_shard * dims.cp})"
        )
    if cfg.training.seq_len > args.max_seq_len:
        raise TitanliteError(
            f"training.seq_len: {cfg.training.seq_len} exceeds the {cfg.model.flavor} flavor's max_seq_len "
            f"{args.max_seq_len}"
        )
    grad_accum_steps = dims.grad_accum_steps(cfg.training.local_batch_size, cfg.training.global_batch_size)
    if cfg.checkpoint.create_seed_checkpoint and world_size != 1:
        raise TitanliteError(f"checkpoint.create_seed_checkpoint: run it on 1 process (got {world_size})")
    n_params = sum(p.numel() for p in model.parameters())
    plan = RunPlan(cfg, spec, args, tokenizer, dims, grad_accum_steps, n_params)
    return dataclasses.replace(plan, pipeline=_plan_pipeline(plan, model)) if dims.pp_enabled else plan


def _whole_model_on_meta(spec: ModelSpec, args: DecoderArgs, cfg: JobConfig) -> torch.nn.Module:
    """The whole model without memory (every pipeline stage's names, every MoE layer), with LoRA's
    adapters when converted: a target that matches nothing is refused here, before any device."""
    with torch.device("meta"):
        model = spec.model_class(args)
    if "lora" in cfg.model.converters:
        lora_adapters(model, cfg.lora)
    return model


def model_args(spec: ModelSpec, model: Any, vocab_size: int) -> DecoderArgs:
    """The flavor's args with the tokenizer's vocabulary; or, with flavor "hf" or a model built
    from its folder (`ModelSpec.folder_args`), the args of `model.hf_assets_path`'s config.json,
    whose table must hold every token id."""
    if model.flavor != "hf" and spec.folder_args is None:
        return spec.args_for(model.flavor, vocab_size)
    args = _folder_args(spec, model.hf_assets_path)
    if vocab_size > args.vocab_size:
        raise TitanliteError(
            f"model.hf_assets_path: the tokenizer has {vocab_size} ids, the model's vocab_size is {args.vocab_size}"
        )
    return args


def _folder_args(spec: ModelSpec, folder: str) -> DecoderArgs:
    """A model built from its folder reads it itself; a native family's adapter reads config.json."""
    if spec.folder_args is not None:
        return spec.folder_args(folder)
    try:
        return spec.hf_adapter.args_from_hf_config(read_hf_config(folder))
    except (KeyError, ValueError) as error:
        raise TitanliteError(f"model.hf_assets_path: {folder}/{HF_CONFIG_FILE}: {error}") from None


def model_label(spec: ModelSpec, model: Any) -> str:
    """What messages call the model: its flavor, or the folder it is built from."""
    return model.hf_assets_path if spec.folder_args else model.flavor


def check_capabilities(spec: ModelSpec, cfg: JobConfig) -> None:
    """The one place a run's options meet what its model declares (`ModelSpec.capabilities`,
    model_spec.py): an option the model cannot serve is refused here, in one line naming the
    option, rather than inside the model's first forward or halfway through a load."""
    needs: list[tuple[bool, str, Capability]] = [
        (cfg.parallelism.pipeline_parallel_degree > 1, "parallelism.pipeline_parallel_degree", "pipeline_split"),
        (cfg.parallelism.context_parallel_degree > 1, "parallelism.context_parallel_degree", "context_parallel"),
        (cfg.model.attn_mask_type == "block_causal", "model.attn_mask_type", "document_mask"),
        (cfg.checkpoint.last_save_in_hf, "checkpoint.last_save_in_hf", "hf_adapter"),
        (cfg.checkpoint.initial_load_format == "hf", "checkpoint.initial_load_format", "hf_adapter"),
    ]
    for needed, option, capability in needs:
        if needed and not spec.supports(capability):
            raise TitanliteError(f"{option}: {spec.lacks(capability)}")


def _plan_pipeline(plan: RunPlan, model: torch.nn.Module) -> PipelineLayout:
    """The stages of a pipelined run, from `model`, the whole model built on meta (no memory)."""
    if shared := shared_parameters(model):
        raise TitanliteError(
            f"parallelism.pipeline_parallel_degree: model {plan.spec.name} {plan.model_label} shares one tensor "
            f"between {shared[0]}, which sit on the first and the last stage; pipeline an untied model"
        )
    costs, args = None, plan.model_args
    n_blocks = args.n_layers  # multi-token prediction's blocks run after the output: on the last stage
    if plan.cfg.parallelism.pipeline_parallel_balance == "flops":
        flops = plan.spec.flops_per_token
        attention = (flops(args, 0, plan.cfg.training.seq_len) - flops(args, 0, 0)) / len(model.layers)
        routed = {layer.experts: layer.args.top_k / layer.args.n_experts for layer in moe.moe_layers(model).values()}
        costs = part_flops(model, attention, routed)
        costs = [*costs[: n_blocks + 1], sum(costs[n_blocks + 1 :])]
    batch = plan.cfg.training.local_batch_size
    return plan_layout(plan.cfg.parallelism, n_blocks, batch, costs, tail_blocks=args.mtp_depths)


def parallelize(model: torch.nn.Module, plan: RunPlan, meshes: Meshes) -> None:
    """The run's settings handed to the public `parallel.parallelize.parallelize` (the order:
    docs/parallelism.md): the trainer takes the library's one path."""
    cfg, dims = plan.cfg, plan.dims
    if cfg.training.mixed_precision_param == "auto":
        raise ValueError("parallelize: decide mixed_precision_param 'auto' first (RunPlan.with_compute_dtype)")
    tp_plan = None
    if dims.tp_enabled:
        sequence_parallel = sequence_parallel_for(meshes.tp, cfg.parallelism.sequence_parallel)
        tp_plan = functools.partial(_apply_tp, plan.spec, cfg.parallelism.enable_loss_parallel, sequence_parallel)
    if dims.fsdp_enabled and cfg.parallelism.fsdp_shard_modules:  # a missing class named by its config key
        select(model, cfg.parallelism.fsdp_shard_modules, "parallelism.fsdp_shard_modules")
    precision = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.training.mixed_precision_param], reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce]
    )
    parallel.parallelize(
        model,
        meshes,
        tp_plan=tp_plan,
        fsdp_modules=cfg.parallelism.fsdp_shard_modules or None,
        reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
        mixed_precision=precision,
        cpu_offload=cfg.training.enable_cpu_offload,
        prefetch=cfg.parallelism.fsdp_prefetch_depth,
        ac=ac_setting(cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option),
        compile=cfg.compile.enable,
        pipelined=dims.pp_enabled,
        expert_tensor_parallel=dims.etp_enabled,
        float8=plan.float8,
        lora=plan.lora,
    )


def _apply_tp(spec: ModelSpec, loss_parallel: bool, sequence_parallel: bool, model: torch.nn.Module, tp_mesh) -> None:
    spec.apply_tp(model, tp_mesh, loss_parallel, sequence_parallel)


@dataclass(frozen=True)
class ModelSize:
    """What the log line and MFU need to know about the built model."""

    n_params: int
    flops_per_token: float


@dataclass(frozen=True)
class BuiltModel:
    """This rank's model: `parts` are what runs forward (the whole model, or this rank's
    pipeline stages), `model` what the optimizer, gradient clipping and checkpoints read
    (the one part, or all of them under the whole model's names). `experts`: the functions
    of its mixture-of-experts layers (models/moe.py, which `step/experts.ExpertLayers`
    describes) when the flavor has any, else None."""

    parts: list[torch.nn.Module]
    model: torch.nn.Module
    size: ModelSize
    experts: Any = None


def build_parts_on_meta(plan: RunPlan, meshes: Meshes) -> list[torch.nn.Module]:
    """The configured model on the meta device (no memory), split into this rank's pipeline
    stages when there are several, each parallelized for this rank."""
    with torch.device("meta"):
        model = plan.spec.model_class(plan.model_args)
    parts = [model]
    if plan.pipeline is not None:
        indices = plan.pipeline.stage_indices(meshes.pp.get_local_rank())
        parts = [split_stage(model, plan.pipeline.stages[index]) for index in indices]
    for part in parts:
        parallelize(part, plan, meshes)
    return parts


def local_model(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One module over this rank's parts (see BuiltModel.model)."""
    return parts[0] if len(parts) == 1 else ModelParts(parts)


def build_on_meta(plan: RunPlan, meshes: Meshes) -> torch.nn.Module:
    """This rank's parallelized model on meta, as one module (the planner's view)."""
    return local_model(build_parts_on_meta(plan, meshes))


def materialize(model: torch.nn.Module, plan: RunPlan, device: torch.device) -> None:
    """Allocate this rank's shards (on the host with CPU offload) and initialize them."""
    for part in model.parts if isinstance(model, ModelParts) else [model]:
        part.to_empty(device="cpu" if plan.cpu_offload else device)
        part.init_weights(seed=plan.cfg.training.seed)
        init_adapters(part, seed=plan.cfg.training.seed)
        part.train()


def build_model(plan: RunPlan, device: torch.device, meshes: Meshes, processes_per_host: int) -> BuiltModel:
    """Build on meta, parallelize, check the training state can fit, then materialize."""
    parts = build_parts_on_meta(plan, meshes)
    model = local_model(parts)
    n_params = plan.n_params
    size = ModelSize(n_params, plan.spec.flops_per_token(plan.model_args, n_params, plan.cfg.training.seq_len))
    check_training_state_fits(n_params, plan.dims.shards, device, plan.cpu_offload, processes_per_host)
    materialize(model, plan, device)
    # experts: models/moe.py's layer functions when the model has MoE layers, which its spec must
    # declare (`Capabilities.moe`: the planner and MFU count such a model's active parameters).
    has_moe = bool(moe.moe_layers(model))
    if has_moe and not plan.spec.supports("moe"):
        raise ValueError(f"model {plan.spec.name} has MoE layers but does not declare ModelSpec.capabilities.moe")
    # A pipeline stage of dense blocks only still joins the stages' load report (a pp collective).
    has_moe = has_moe or plan.model_args.n_moe_layers > 0
    return BuiltModel(parts, model, size, experts=moe if has_moe else None)
