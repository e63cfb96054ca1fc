"""One rank of a training *session*: several trainer runs, one after another, in one process
group (tests/helpers/sessions.py starts the ranks).

Usage: python tests/helpers/session_worker.py OUT.json CASES.json

CASES.json is a list of {"name", "argv", "copy_checkpoint": [folder, step] or null, "call"}. Each case
builds a `Trainer` from its argv (its own dump folder), trains, records every logged step,
each rank's local bytes and, with validation on, the validation loss after training, and
closes (a `create_seed_checkpoint` case writes its seed instead); `init_distributed` joins the group the first case
started, so a case costs its model build and steps, not a process start and a rendezvous.
`copy_checkpoint` puts `folder/checkpoint/step-N` into the case's checkpoint folder first
(rank 0), so the case resumes from it. A `call` case ("module:function") runs that function
instead and records its result under "checks". A case that fails records its error and the
session goes on with the next. Rank 0 writes {name: {"history", "ranks", "error"}} after each case.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.build import plan_run
from titanlite.config import load_config
from titanlite.models.moe import moe_layers
from titanlite.parallel.distributed import init_distributed, world_from_env
from titanlite.trainer import Trainer, create_seed_checkpoint


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def held_bytes(trainer: Trainer) -> dict[str, int]:
    """What this rank holds: its shards of parameters, gradients and AdamW state."""
    params = trainer.params
    optim = [
        v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0
    ]
    return {
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(p.grad for p in params),
        "optim_bytes": local_bytes(optim),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in params),
        # What a LoRA run freezes: this rank's shards of it, and of any gradient it got (none should).
        "frozen_param_bytes": local_bytes(p for p in trainer.model.parameters() if not p.requires_grad),
        "frozen_grad_bytes": local_bytes(p.grad for p in trainer.model.parameters() if not p.requires_grad),
        "norm_param_bytes": sum(
            p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "norm" in n
        ),
        # This rank's shards of the routed experts: split over ep, then by the experts' FSDP over efsdp.
        "expert_param_bytes": local_bytes(p for n, p in trainer.model.named_parameters() if ".experts." in n),
        # A mixture-of-experts layer's router and routed experts, which tensor parallelism keeps whole on each rank.
        "moe_param_bytes": sum(
            p.numel() * p.element_size()
            for n, p in trainer.model.named_parameters()
            if ".router." in n or ".experts." in n
        ),
        # How the parameters are laid out (mesh dim names and placements, each layout once) and
        # a sum of this rank's local values: ranks that train on different batches hold equal
        # whole weights only when their gradients were all-reduced.
        "param_layouts": sorted({layout(p) for p in params}),
        "local_param_sum": sum(
            float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum()) for p in params
        ),
        # MLA's projections into its compressed latents (DeepSeek-V3), also whole on each tp rank.
        "latent_param_bytes": sum(
            p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if ".wkv_a." in n or ".wq_a." in n
        ),
    }


def layout(param: torch.Tensor) -> str:
    """`dim=placement,...` of a DTensor parameter (e.g. `dp_replicate=R`, `tp=S(0)`), `plain` otherwise."""
    if not isinstance(param, DTensor):
        return "plain"
    names = param.device_mesh.mesh_dim_names or ()
    return ",".join(f"{name}={placement}" for name, placement in zip(names, param.placements))


def watch_expert_compute(trainer: Trainer) -> dict[str, int]:
    """The routed-experts bytes this rank computes with, as each MoE layer's experts see
    their weights in forward (after FSDP's all-gather): the whole stack without expert
    parallelism, this rank's experts with it. Summed over the layers of this rank."""
    seen: dict[int, int] = {}

    def record(module, _inputs) -> None:
        seen[id(module)] = local_bytes(module.parameters())

    for part in trainer.model_parts:
        for layer in moe_layers(part).values():
            layer.experts.register_forward_pre_hook(record)
    return seen


def optimizer_groups(trainer: Trainer, names: dict[int, str]) -> list[dict]:
    """Each param group's rule, starting lr, weight decay and parameter names (`names`: id -> name
    of the parameters the optimizer was built from, read before training: after a validation
    forward FSDP2's root may hold its unsharded tensors as the module's parameters, not them)."""
    return [
        {
            "group": g["group"],
            "initial_lr": g["initial_lr"],
            "weight_decay": g["weight_decay"],
            "params": [names[id(p)] for p in g["params"]],
        }
        for g in trainer.optimizer.param_groups
    ]


def copy_checkpoint(source: str, step: int, cfg) -> None:
    """Hard links, not copies: a resume only reads the saved step and writes new ones beside it,
    and the resume module's ~30 copies would otherwise add gigabytes to the suite's disk."""
    target = Path(cfg.job.dump_folder) / cfg.checkpoint.folder / f"step-{step}"
    shutil.rmtree(target.parent, ignore_errors=True)
    shutil.copytree(Path(source) / "checkpoint" / f"step-{step}", target, copy_function=os.link)


def run_case(case: dict) -> dict:
    if case.get("call"):
        module, function = case["call"].split(":")
        init_distributed()
        return {
            "checks": getattr(importlib.import_module(module), function)(),
            "history": [],
            "ranks": [],
            "error": None,
        }
    cfg = load_config(case["argv"])
    if case.get("copy_checkpoint") and int(world_from_env()[0]) == 0:
        copy_checkpoint(*case["copy_checkpoint"], cfg)
    if dist.is_initialized():
        dist.barrier()
    plan = plan_run(cfg, world_from_env()[1])
    if cfg.checkpoint.create_seed_checkpoint:
        create_seed_checkpoint(plan)
        return {"history": [], "ranks": [], "validation_loss": None, "error": None}
    trainer = Trainer(plan)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    expert_compute = watch_expert_compute(trainer)
    try:
        history = trainer.train()
        sizes = {
            **held_bytes(trainer),
            "expert_compute_bytes": sum(expert_compute.values()),
            "optimizer_groups": optimizer_groups(trainer, names),
            # Muon's last step on this rank: matrices it orthogonalized, bytes of other ranks' blocks it received.
            "muon_owned": getattr(trainer.optimizer, "last_owned", None),
            "muon_gathered_bytes": getattr(trainer.optimizer, "last_gathered_bytes", None),
            "muon_matrix_bytes": sum(
                p.numel() * p.element_size()
                for g in trainer.optimizer.param_groups
                if g.get("algorithm") == "muon"
                for p in g["params"]
            ),
        }
        validation = trainer.validator.evaluate() if trainer.validator is not None else None
    finally:
        trainer.close()
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, sizes)
    return {"history": history, "ranks": ranks, "validation_loss": validation, "error": None}


def main() -> None:
    out_path, cases_path = sys.argv[1], sys.argv[2]
    results = {}
    for case in json.loads(Path(cases_path).read_text()):
        try:
            results[case["name"]] = run_case(case)
        except BaseException as error:  # recorded; the next case runs on
            results[case["name"]] = {
                "history": [],
                "ranks": [],
                "error": f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}",
            }
        print(f"@@session case {case['name']} done", flush=True)
        if int(world_from_env()[0]) == 0:  # after every case: a session stopped later keeps what it finished
            write_results(out_path, results)
    dist.destroy_process_group()


def write_results(path: str, results: dict) -> None:
    """Whole or not at all: a reader never sees half a file."""
    temporary = Path(f"{path}.tmp")
    temporary.write_text(json.dumps(results))
    temporary.replace(path)


if __name__ == "__main__":
    main()
