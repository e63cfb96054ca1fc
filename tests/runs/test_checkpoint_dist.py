"""The checkpoint mechanism on real gloo process groups, without the trainer: a tiny Llama
sharded FSDP 2 x TP 2 (4 processes) or FSDP 2, spawned with torch.multiprocessing.

- full-state export of a sharded model loads into a plain model with the same logits;
  Hugging Face and DCP initial loads put back exactly the exported weights; a
  model_weights_only final save holds the model alone, cast to export_dtype;
- `async_with_pinned_mem` (DCP's writer process) writes a checkpoint that resumes
  bit-exactly (the trainer tests use "async").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.gloo_llama import build, checkpoint_cfg, full_logits, init_gloo, manager_for, spawn
from tests.helpers.stand_ins import CountingLoader


def export_worker(rank: int, world: int, port: int, folder: str) -> None:
    from titanlite.checkpoint import export, hf_io
    from titanlite.models.llama import llama3_hf as hf_adapter
    from titanlite.models.llama.model import Llama

    init_gloo(rank, world, port)
    folder = Path(folder)
    args, model = build(2, 2, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sharded_logits = full_logits(model, tokens)
    full = export.full_model_state_dict(model)
    if rank == 0:
        torch.save(full, folder / "full.pt")
        hf_io.save_hf_weights(full, folder / "hf", hf_adapter, args)
        plain = Llama(args)
        plain.init_weights(seed=123)
        plain.load_state_dict(torch.load(folder / "full.pt", weights_only=True))
        with torch.no_grad():
            torch.testing.assert_close(plain(tokens), sharded_logits, rtol=1e-5, atol=1e-5)
    # The same weights as a DCP checkpoint (model + optimizer), for the dcp initial load.
    source = manager_for(checkpoint_cfg(async_mode="disabled"), folder / "run", args, model)
    source.save(1, last=True)
    source.close()
    # The final save of a model_weights_only run: model only, cast to export_dtype.
    weights = manager_for(
        checkpoint_cfg(async_mode="disabled", model_weights_only=True, export_dtype="bfloat16"),
        folder / "wo",
        args,
        model,
    )
    weights.save(3, last=True)
    weights.close()
    dist.barrier()
    if rank == 0:
        from titanlite.checkpoint import commit

        saved = export.read_dcp_tensors(folder / "wo" / "checkpoint" / "step-3")
        assert saved.keys() == {f"model.{k}" for k in full} and all(v.dtype == torch.bfloat16 for v in saved.values())
        assert all(torch.equal(saved[f"model.{k}"], v.to(torch.bfloat16)) for k, v in full.items())
        record = commit.read_commit(folder / "wo" / "checkpoint" / "step-3")
        assert record.model_weights_only and record.export_dtype == "bfloat16" and record.contents == ["model"]
    for fmt, path in (("hf", folder / "hf"), ("dcp", folder / "run" / "checkpoint" / "step-1")):
        _, fresh = build(2, 2, seed=7)
        cfg = checkpoint_cfg(enable_checkpoint=False, initial_load_path=str(path), initial_load_format=fmt)
        manager = manager_for(cfg, folder / f"unused-{fmt}", args, fresh)
        manager.load()
        manager.close()
        loaded = export.full_model_state_dict(fresh)
        if rank == 0:
            assert loaded.keys() == full.keys()
            for key in full:
                assert torch.equal(loaded[key], full[key]), f"{fmt}: {key}"
    dist.barrier()
    dist.destroy_process_group()


def resume_worker(rank: int, world: int, port: int, folder: str, mode: str, stop: int, end: int, out: str) -> None:
    from titanlite.checkpoint.train_state import TrainState

    init_gloo(rank, world, port)
    args, model = build(world, 1, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    loader, state = CountingLoader(), TrainState()
    manager = manager_for(checkpoint_cfg(async_mode=mode), folder, args, model, optimizer, scheduler, loader, state)
    manager.load()
    losses = []
    while state.step < stop:
        state.step += 1
        loader.position += 1
        tokens = torch.randint(
            0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(loader.position * 10 + rank)
        )
        loss = full_logits(model, tokens).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        manager.save(state.step, last=state.step == end)
    manager.close()
    if rank == 0:
        with open(out, "a") as f:
            f.write(" ".join(repr(x) for x in losses) + "\n")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_sharded_export_and_initial_loads_fsdp2_tp2(tmp_path):
    spawn(export_worker, 4, str(tmp_path))
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() and (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.timeout(240)
def test_async_with_pinned_mem_resumes_bit_exactly(tmp_path):
    """4 steps straight, saving step 2 through DCP's writer process; then a second run
    resumes from that step-2 checkpoint: same losses, same final tensors, bit for bit."""
    from titanlite.checkpoint import export

    out = tmp_path / "losses.txt"
    spawn(resume_worker, 2, str(tmp_path / "a"), "async_with_pinned_mem", 4, 4, str(out), timeout=200)
    assert (tmp_path / "a" / "checkpoint" / "step-2" / "commit.json").is_file()
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-2", tmp_path / "b" / "checkpoint" / "step-2")
    spawn(resume_worker, 2, str(tmp_path / "b"), "async_with_pinned_mem", 4, 4, str(out), timeout=200)
    straight, resumed = [line.split() for line in out.read_text().splitlines()]
    assert resumed == straight[2:]
    # Model and optimizer tensors; the RNG entries may differ in kind: pinning memory
    # initializes CUDA where it exists, and then CUDA's RNG state is saved too.
    left, right = (
        {
            k: v
            for k, v in export.read_dcp_tensors(tmp_path / run / "checkpoint" / "step-4").items()
            if not k.startswith("train_state.")
        }
        for run in ("a", "b")
    )
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
