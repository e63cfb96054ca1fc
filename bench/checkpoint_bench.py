"""How long a checkpoint stops training, per `checkpoint.async_mode`, on the debug model.

    python bench/checkpoint_bench.py [--flavor debugmodel] [--saves 3] [--steps-between 2]

One process (gloo, world of 1) trains the model with AdamW and saves the full training
state (model, optimizer, scheduler, data position, train state) through the real
CheckpointManager. For each mode it reports the median over `--saves` saves, after one
warm-up save (the writer process of async_with_pinned_mem starts, and its shared-memory
staging buffers are allocated, on the first save):

- disabled: the blocking save time (the loop waits for the write);
- async, async_with_pinned_mem: the stall, i.e. the time `save()` keeps the loop (state
  dicts + hand-off) plus the time the following optimizer step waited for the background
  staging copy (its `StepGate`), with the copy and the write overlapping the following
  training steps; and how long the background write took to commit.

Prints figures and the stall / blocking ratios; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere


class _Position:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument(
        "--steps-between", type=int, default=2, help="training steps between saves (the write overlaps them)"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--modes", default="disabled,async,async_with_pinned_mem")
    args = parser.parse_args()

    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.checkpoint.train_state import TrainState
    from titanlite.config import Checkpoint
    from titanlite.logging import init_logger
    from titanlite.models import get_model_spec
    from titanlite.parallel.distributed import init_distributed

    device = init_distributed(600).device  # as the trainer: NCCL on CUDA, gloo on CPU, a world of one
    init_logger(0)
    import logging

    logging.getLogger("titanlite").setLevel(logging.WARNING)  # keep the bench output to figures
    spec = get_model_spec("llama3", args.flavor)
    model_args = spec.args_for(args.flavor, args.vocab_size)
    with torch.device("meta"):
        model = spec.model_class(model_args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state, data = TrainState(), _Position()
    n_params = sum(p.numel() for p in model.parameters())
    state_mib = 3 * n_params * 4 / 2**20  # weights + two AdamW moments, fp32

    def train_step() -> None:
        tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq_len + 1), device=device)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        data.position += 1
        if device.type == "cuda":
            torch.cuda.synchronize()

    train_step()
    print(
        f"{args.flavor}: {n_params / 1e6:.1f} M parameters, {state_mib:.0f} MiB of model + optimizer state; "
        f"device {device.type}, torch {torch.__version__}"
    )
    results: dict[str, tuple[float, float]] = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as folder:
            cfg = Checkpoint(enable_checkpoint=True, interval=1, async_mode=mode, keep_latest_k=2)
            manager = CheckpointManager(
                cfg,
                folder,
                spec,
                args.flavor,
                model_args,
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                dataloader=data,
                train_state=state,
            )
            stalls, holds, writes = [], [], []
            for index in range(args.saves + 1):
                for _ in range(args.steps_between):
                    train_step()
                saved = {k: v.clone() for k, v in model.state_dict().items()}  # what the save must hold
                started = time.perf_counter()
                manager.save(state.step, last=False)
                stall = time.perf_counter() - started
                held_before = _held_s(manager)
                train_step()  # the step the background copy overlaps
                held = _held_s(manager) - held_before
                stall += held
                manager.wait()  # untimed for the loop: how long until the background write committed
                total = time.perf_counter() - started
                if index > 0:  # the first save is a warm-up
                    stalls.append(stall)
                    holds.append(held)
                    writes.append(total)
            manager.close()
            reload = _reloads_exactly(cfg, folder, saved, spec, model_args, args.flavor)
        results[mode] = (statistics.median(stalls), statistics.median(writes))
        print(
            f"{mode:>22}: loop stall {results[mode][0] * 1e3:8.1f} ms (of which the step waited for staging "
            f"{statistics.median(holds) * 1e3:.1f} ms)   save committed after {results[mode][1] * 1e3:8.1f} ms"
            f"   reload {'bit-exact' if reload else 'MISMATCH'}"
        )
    if "disabled" in results:
        blocking = results["disabled"][0]
        for mode in results:
            if mode != "disabled":
                print(f"stall/blocking {mode}: {results[mode][0] / blocking:.3f}")
    dist.destroy_process_group()


def _held_s(manager) -> float:
    """Seconds optimizer steps have waited for background staging (0 for blocking saves)."""
    staging = getattr(manager.saver, "staging", None)
    return staging.gate.held_s if staging is not None else 0.0


def _reloads_exactly(cfg, folder: str, saved: dict[str, torch.Tensor], spec, model_args, flavor: str) -> bool:
    """Sanity check, not a test: the newest checkpoint loads back into a fresh model and
    optimizer and gives exactly the weights of its step, though training stepped on while
    the save was staged and written."""
    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.checkpoint.train_state import TrainState

    device = next(iter(saved.values())).device
    with torch.device("meta"):
        fresh = spec.model_class(model_args)
    fresh.to_empty(device=device)
    fresh.init_weights(seed=1)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    manager = CheckpointManager(
        cfg,
        folder,
        spec,
        flavor,
        model_args,
        model=fresh,
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        dataloader=_Position(),
        train_state=TrainState(),
    )
    manager.load()
    manager.close()
    return all(torch.equal(a, b) for a, b in zip(saved.values(), fresh.state_dict().values()))


if __name__ == "__main__":
    main()
