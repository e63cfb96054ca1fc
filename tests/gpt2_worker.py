"""One run of the parallel-equivalence test in tests/test_gpt2.py (a helper, not a test).

    python tests/gpt2_worker.py --tp 1 --out ref.json                      # 1 process
    torchrun --standalone --nproc-per-node 4 tests/gpt2_worker.py --tp 2 --out r.json

Trains a tiny fp32 GPT-2 for a few steps on fixed random tokens, with the data-parallel
degree filling the world (FSDP) and the given TP degree, parallelized in the trainer's
order (TP plan, then FSDP per block and root), and writes rank 0's losses and grad norms.
The global batch is the same for every layout, split across data-parallel ranks.
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.models.gpt2 import GPT2Args, gpt2_spec
from titanlite.parallel.fsdp import apply_fsdp
from titanlite.parallel.grad_norm import clip_gradients_
from titanlite.parallel.mesh import ParallelDims

ARGS = GPT2Args(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32)
SEQ_LEN, GLOBAL_BATCH, SEED, DATA_SEED, MAX_NORM, LR = 32, 4, 0, 1234, 1.0, 1e-3


def build(dims: ParallelDims, mesh) -> torch.nn.Module:
    """Meta build -> TP -> FSDP -> materialize -> init, as `titanlite.train` does."""
    with torch.device("meta"):
        model = gpt2_spec.model_class(ARGS)
    if dims.tp_enabled:
        gpt2_spec.apply_tp(model, ParallelDims.tp_mesh(mesh), True)
    if dims.fsdp_enabled:
        apply_fsdp(
            model, ParallelDims.fsdp_mesh(mesh), param_dtype="float32", reduce_dtype="float32",
            reshard_after_forward="default", cpu_offload=False, prefetch_depth=0, shard_module_classes=[],
        )
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    return model


def run(tp: int, steps: int) -> dict[str, list[float]]:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    parallelism = SimpleNamespace(data_parallel_replicate_degree=1, data_parallel_shard_degree=-1, tensor_parallel_degree=tp)
    dims = ParallelDims.from_config(parallelism, world)
    mesh = dims.build_mesh("cpu")
    dp_mesh = ParallelDims.dp_mesh(mesh)
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0

    model = build(dims, mesh)
    params = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    data = torch.randint(0, ARGS.vocab_size, (steps, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(DATA_SEED))
    local_batch = GLOBAL_BATCH // dims.dp

    losses, norms = [], []
    for step in range(steps):
        window = data[step, dp_rank * local_batch : (dp_rank + 1) * local_batch]
        inputs, labels = window[:, :-1], window[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        with loss_parallel() if dims.tp_enabled else torch.enable_grad():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        norm = clip_gradients_(params, MAX_NORM, world=world > 1)
        optimizer.step()
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        if dp_mesh is not None:
            dist.all_reduce(loss, group=dp_mesh.get_group())
            loss /= dims.dp
        losses.append(loss.item())
        norms.append(norm.item())
    if world > 1:
        dist.destroy_process_group()
    return {"losses": losses, "grad_norms": norms}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    result = run(options.tp, options.steps)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(options.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
