"""DiLoCo in plain torch over the real trainer, for tests/runs/test_fault_tolerance.py: two
replica groups as two one-process `Trainer`s in this process, each reading its share of every
global batch (dp rank g of 2) and stepping its own AdamW (the inner optimizer, with clipping and
the lr schedule as the trainer does); every `sync_steps` steps the pseudo-gradients (global
weights minus each group's) are averaged and an outer SGD with Nesterov momentum steps the global
weights, which both groups then take; the groups' expert biases (an MoE model's buffers) are
averaged at each sync too, as titanlite's fault tolerance does.

Usage: diloco_reference.py OUT.json SYNC_STEPS DUMP_FOLDER OUTERS [--key value ...], OUTERS a JSON
list of [outer_lr, outer_momentum] pairs, one DiLoCo each (lr 1 and momentum 0 is local SGD: the
new global weights are the groups' average). Writes, per pair, {"histories": [[{"step", "loss",
"grad_norm"}, ...] per group], "sums": [...] per group, "biases": [{name: values}] per group}, as a
JSON list.
"""

from __future__ import annotations

import json
import sys

import torch

from titanlite.build import plan_run
from titanlite.config import load_config
from titanlite.trainer import Trainer

GROUPS = 2


def diloco(argv: list[str], sync_steps: int, outer_lr: float, momentum: float, dump: str) -> dict:
    trainers = []
    for g in range(GROUPS):
        trainer = Trainer(plan_run(load_config([*argv, "--job.dump_folder", f"{dump}/group{g}"]), 1))
        trainer.data.dp_rank, trainer.data.dp_degree = g, GROUPS  # group g's share of each global batch
        trainers.append(trainer)
    global_weights = [p.detach().clone() for p in trainers[0].params]
    outer = torch.optim.SGD(global_weights, lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    histories = [[] for _ in trainers]
    for step in range(1, trainers[0].cfg.training.steps + 1):
        for trainer, history in zip(trainers, histories):
            trainer.state.step = step
            loss, grad_norm, _ = trainer.train_step([next(trainer.data)])
            history.append({"step": step, "loss": loss.item(), "grad_norm": grad_norm.item()})
        if step % sync_steps == 0:
            with torch.no_grad():
                for index, weights in enumerate(global_weights):
                    weights.grad = sum(weights - t.params[index] for t in trainers) / GROUPS
                outer.step()
                outer.zero_grad()
                for trainer in trainers:
                    for p, weights in zip(trainer.params, global_weights):
                        p.copy_(weights)
                for buffers in zip(*(biases(t) for t in trainers)):
                    average = sum(buffers) / GROUPS
                    for buffer in buffers:
                        buffer.copy_(average)
    sums = [[p.detach().double().sum().item() for p in t.params] for t in trainers]
    ends = [{name: b.tolist() for name, b in t.model.named_buffers() if name.endswith("expert_bias")} for t in trainers]
    for trainer in trainers:
        trainer.close()
    return {"histories": histories, "sums": sums, "biases": ends}


def biases(trainer: Trainer) -> list[torch.Tensor]:
    return [b for name, b in trainer.model.named_buffers() if name.endswith("expert_bias")]


def main() -> None:
    out_path, sync_steps, dump, outers = sys.argv[1:5]
    results = [
        diloco(sys.argv[5:], int(sync_steps), lr, momentum, f"{dump}/{index}")
        for index, (lr, momentum) in enumerate(json.loads(outers))
    ]
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
