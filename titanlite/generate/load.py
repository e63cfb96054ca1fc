"""The trainer's model for generation: planned, checked against the checkpoint as a resume
checks it, built at this rank's layout and loaded by the trainer's own initial-load path."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.build import RunPlan, build_parts_on_meta, local_model, materialize, plan_run
from titanlite.checkpoint import integrity, policy
from titanlite.checkpoint.commit import fingerprint
from titanlite.checkpoint.contents import Contents
from titanlite.checkpoint.restore import Restorer, check_model, check_tokenizer
from titanlite.config import JobConfig
from titanlite.logging import logger
from titanlite.parallel.collectives import on_rank0
from titanlite.parallel.distributed import new_group
from titanlite.parallel.mesh import Meshes
from titanlite.step.precision import resolve_compute_dtype


@dataclass(frozen=True)
class LoadedModel:
    """This rank's share of the loaded model, in eval mode: `parts` are the whole model, or
    this rank's pipeline stages in the order it holds them."""

    plan: RunPlan
    meshes: Meshes
    parts: list[torch.nn.Module]


def load_model(cfg: JobConfig, world_size: int, device: torch.device) -> LoadedModel:
    """Built as the trainer builds it, weights loaded by the trainer's `Restorer`.
    `build_model`'s check that the optimizer state fits is skipped: generation holds the
    weights only."""
    plan = plan_run(cfg, world_size)
    if cfg.checkpoint.initial_load_format == "dcp":
        on_rank0(dist.group.WORLD, lambda: check_checkpoint(plan))
    choice = resolve_compute_dtype(cfg.training.mixed_precision_param, device)
    hint = "" if choice.name == "float32" else "; --training.mixed_precision_param float32 decodes in float32"
    logger.info(f"generate: compute dtype {choice.name} ({choice.reason}){hint}")
    plan = causal(plan.with_compute_dtype(choice.name))
    meshes = plan.dims.build_mesh(device.type)
    parts = build_parts_on_meta(plan, meshes)
    model = local_model(parts)
    materialize(model, plan, device)
    group = new_group(backend="gloo", group_desc="checkpoint")  # DCP on a CPU group, as the Checkpointer does
    contents = Contents(model, None, None, None, None)
    checkpoint = Path(cfg.checkpoint.initial_load_path)
    Restorer(plan.cfg.checkpoint, checkpoint, plan.spec, cfg.model.flavor, plan.model_args, contents, group).load()
    model.eval()
    return LoadedModel(plan, meshes, parts)


def check_checkpoint(plan: RunPlan) -> None:
    """What a resume checks before it reads a tensor, with errors naming --checkpoint: a
    titanlite checkpoint was trained with this tokenizer (another would decode garbage,
    silently) and holds the configured model (name, flavor, hyperparameters)."""
    cfg = plan.cfg
    path, record = policy.resolve_initial_load(Path(cfg.checkpoint.initial_load_path), "--checkpoint")
    if record is None:  # another DCP writer's (torchtitan's): only the shapes are checked, on load
        return
    check_tokenizer(path, record, integrity.tokenizer_record(plan.tokenizer))
    check_model(path, record, fingerprint(plan.spec.name, cfg.model.flavor, plan.model_args), plan.model_args)


def causal(plan: RunPlan) -> RunPlan:
    """The plan with causal attention: each prompt is one document. (The checkpoint's
    fingerprint was compared with the configured mask type, which is part of it.)"""
    if not plan.spec.supports("document_mask") or plan.model_args.attn_mask_type == "causal":
        return plan
    return dataclasses.replace(plan, model_args=dataclasses.replace(plan.model_args, attn_mask_type="causal"))
