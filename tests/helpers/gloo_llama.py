"""A tiny Llama (or another registered model's args) on real gloo process groups, spawned
with torch.multiprocessing: built at any FSDP x TP layout, its full logits, a checkpoint
manager for it, and the spawn that bounds the workers by a timeout (a hang fails the test
instead of blocking CI)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import warm_start
from tests.helpers.distributed import free_port
from tests.helpers.stand_ins import CountingLoader
from titanlite.config import Checkpoint

ARGS = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=32)


def checkpoint_cfg(**overrides) -> Checkpoint:
    return Checkpoint(**{"enable_checkpoint": True, "interval": 2, "keep_latest_k": 2, **overrides})


def build(dp: int, tp: int, seed: int, spec=None, args=None):
    """The tiny Llama of ARGS, or `spec`'s model of `args`, at FSDP dp x TP tp."""
    from titanlite.models.llama import llama3_spec
    from titanlite.models.llama.model import LlamaArgs
    from titanlite.parallel.parallelize import parallelize
    from titanlite.parallel.mesh import ParallelDims

    spec, args = spec or llama3_spec, args or LlamaArgs(**ARGS)
    meshes = ParallelDims(1, dp, tp, dp * tp).build_mesh("cpu")
    with torch.device("meta"):
        model = spec.model_class(args)
    if tp > 1:
        spec.apply_tp(model, meshes.tp, False, False)
    if dp > 1:
        parallelize(model, meshes.fsdp)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return args, model


def manager_for(cfg, folder, args, model, optimizer=None, scheduler=None, loader=None, state=None, spec=None):
    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.checkpoint.train_state import TrainState
    from titanlite.models.llama import llama3_spec

    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    return CheckpointManager(
        cfg,
        str(folder),
        spec or llama3_spec,
        "tiny",
        args,
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        dataloader=loader or CountingLoader(),
        train_state=state or TrainState(),
    )


def full_logits(model, tokens):
    from torch.distributed.tensor import DTensor

    out = model(tokens)
    return out.full_tensor() if isinstance(out, DTensor) else out


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")


def spawn(fn, world: int, *args, timeout: float = 120) -> None:
    port = free_port()  # below the ephemeral range: see its docstring
    warm_start.server()  # the ranks fork from the warm interpreter, without importing torch again
    context = mp.start_processes(fn, args=(world, port, *args), nprocs=world, start_method="forkserver", join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{fn.__name__} did not finish in {timeout} s")
