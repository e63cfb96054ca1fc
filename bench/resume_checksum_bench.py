"""What verifying shard checksums costs a resume, on the debug model.

    python bench/resume_checksum_bench.py [--flavor debugmodel] [--repeats 5]

One process (gloo, world of 1) trains the model for a step with AdamW and saves the full
training state through the real CheckpointManager. A copy of that checkpoint has the
checksums taken out of its commit.json. Then the real resume path (`CheckpointManager.load`:
checks, checksum verification, DCP load into the live objects) runs on the two copies in
turn, `--repeats` times each, and the script prints the median of each, their ratio, and
the CRC-32 rate alone. Both copies are read in turn, so the page cache treats them alike.
Prints figures; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere


def build(flavor: str, vocab_size: int):
    from titanlite.models import get_model_spec

    spec = get_model_spec("llama3", flavor)
    args = spec.args_for(flavor, vocab_size)
    model = spec.model_class(args)
    model.init_weights(seed=0)
    return spec, args, model


def manager_for(dump: Path, flavor: str, vocab_size: int):
    from tests.helpers.stand_ins import CountingLoader
    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.checkpoint.train_state import TrainState
    from titanlite.config import Checkpoint

    spec, args, model = build(flavor, vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = Checkpoint(enable_checkpoint=True, async_mode="disabled", interval=1)
    manager = CheckpointManager(
        cfg,
        str(dump),
        spec,
        flavor,
        args,
        model=model,
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        dataloader=CountingLoader(),
        train_state=TrainState(),
    )
    return manager, model, optimizer


def save_one(dump: Path, flavor: str, vocab_size: int) -> Path:
    manager, model, optimizer = manager_for(dump, flavor, vocab_size)
    model(torch.randint(0, vocab_size, (2, 64))).float().mean().backward()
    optimizer.step()
    manager.save(1, last=True)
    manager.close()
    return dump / "checkpoint" / "step-1"


def timed_load(dump: Path, flavor: str, vocab_size: int) -> float:
    manager, _, _ = manager_for(dump, flavor, vocab_size)
    started = time.perf_counter()
    manager.load()
    seconds = time.perf_counter() - started
    manager.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from titanlite.checkpoint import commit, integrity
    from titanlite.parallel.distributed import init_distributed

    init_distributed(600)
    with tempfile.TemporaryDirectory() as tmp:
        checked = Path(tmp) / "checked"
        step = save_one(checked, args.flavor, args.vocab_size)
        unchecked = Path(tmp) / "unchecked"
        shutil.copytree(checked, unchecked)
        marker = unchecked / "checkpoint" / "step-1" / commit.COMMIT_FILE
        record = json.loads(marker.read_text())
        record["checksums"] = {}
        marker.write_text(json.dumps(record))

        size = sum(p.stat().st_size for p in step.glob("*.distcp"))
        started = time.perf_counter()
        for name in commit.read_commit(step).checksums:
            integrity.file_crc32(step / name)
        crc_seconds = time.perf_counter() - started

        times: dict[str, list[float]] = {"with checksums": [], "without": []}
        for _ in range(args.repeats):
            times["with checksums"].append(timed_load(checked, args.flavor, args.vocab_size))
            times["without"].append(timed_load(unchecked, args.flavor, args.vocab_size))
    with_, without = (statistics.median(v) for v in times.values())
    print(
        f"{args.flavor}: checkpoint shards {size / 2**20:,.1f} MiB; CRC-32 alone {crc_seconds:.3f} s "
        f"({size / 2**20 / crc_seconds:,.0f} MiB/s)"
    )
    print(
        f"resume (CheckpointManager.load), median of {args.repeats}: with checksums {with_:.3f} s, without "
        f"{without:.3f} s, "
        f"ratio {with_ / without:.3f}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
