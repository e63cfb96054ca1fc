"""Run the real trainer on several processes and write what tests compare to a JSON file.

Usage (by tests/helpers/distributed.py): run_ranks(N, [tests/helpers/trainer_worker.py, OUT.json], [--config ...])
Rank 0 writes {"history": [...], "ranks": [{"param_bytes", "grad_bytes", "optim_bytes"}, ...]}:
the logged scalars of every step and, per rank, the bytes it holds locally (DTensor shards
counted by their local tensors), so tests can check both numerics and sharding.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from tests.helpers.session_worker import held_bytes
from titanlite.build import plan_run
from titanlite.config import load_config
from titanlite.parallel.distributed import world_from_env
from titanlite.trainer import Trainer


def main() -> None:
    out_path, argv = sys.argv[1], sys.argv[2:]
    cfg = load_config(argv)
    trainer = Trainer(plan_run(cfg, world_from_env()[1]))
    history = trainer.train()
    sizes = held_bytes(trainer)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sizes)
    trainer.close()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"history": history, "ranks": gathered}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
