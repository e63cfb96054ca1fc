"""One rank of one replica group of a fault-tolerant run: train, then write what the tests compare.

Usage (a torchrun-style worker of tests/runs/test_fault_tolerance.py): ft_worker.py OUT.json [--key value ...]
Group rank 0 writes {"history", "checksums", "weights", "sums", "biases"}: the logged scalars
of every step this group logged; per group rank, a SHA-256 of the bytes of its local parameter
shards, buffers (expert biases) and optimizer state, so two groups' states can be compared bit
for bit; rank 0's SHA-256 of its parameter shards and buffers after every step (after a DiLoCo
sync, which runs in the optimizer step); rank 0's float64 sum of each parameter shard at the
end; and rank 0's expert biases at the end (by buffer name).
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.build import plan_run
from titanlite.config import load_config
from titanlite.parallel.distributed import world_from_env
from titanlite.trainer import Trainer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_checksum(trainer: Trainer) -> str:
    """A digest of the exact bytes of this rank's parameter shards, buffers (expert biases) and
    optimizer state."""
    digest = hashlib.sha256()
    for name, p in [*trainer.model.named_parameters(), *trainer.model.named_buffers()]:
        digest.update(name.encode())
        digest.update(_local(p.detach()).contiguous().numpy().tobytes())
    for p in trainer.params:
        for key, value in sorted(trainer.optimizer.state.get(p, {}).items()):
            digest.update(key.encode())
            digest.update(_local(value).detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def weights_checksum(tensors: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for p in tensors:
        digest.update(_local(p.detach()).contiguous().numpy().tobytes())
    return digest.hexdigest()


class RecordingTrainer(Trainer):
    """The trainer, noting its weights after every step."""

    def train_step(self, microbatches):
        result = super().train_step(microbatches)
        self.weights.append(weights_checksum([*self.params, *self.model.buffers()]))
        return result


def main() -> None:
    out_path, argv = sys.argv[1], sys.argv[2:]
    trainer = RecordingTrainer(plan_run(load_config(argv), world_from_env()[1]))
    trainer.weights = []
    history = trainer.train()
    sums = [_local(p.detach()).double().sum().item() for p in trainer.params]
    biases = {name: b.tolist() for name, b in trainer.model.named_buffers() if name.endswith("expert_bias")}
    checksums = [None] * dist.get_world_size()
    dist.all_gather_object(checksums, state_checksum(trainer))
    trainer.close()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "history": history,
                    "checksums": checksums,
                    "weights": trainer.weights,
                    "sums": sums,
                    "biases": biases,
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
