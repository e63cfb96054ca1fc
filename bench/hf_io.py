"""Per-rank memory of Hugging Face loads and saves: each rank holds its shard, not the model.

    python bench/hf_io.py [--dim 1024] [--layers 16] [--vocab 32000] [--procs 1 4]

transformers writes a random Llama of a custom size (a few hundred million parameters,
float32, `save_pretrained` in 200 MB files). Then, for each process count, that many gloo
ranks build the titanlite model FSDP-sharded over all of them, load the folder through the
trainer's own restore path (`checkpoint.initial_load_format = "hf"`: DCP's HF reader, each
rank reading its slices) and save it back (`hf_io.save_hf_weights`: each rank writes its
shards, then the ranks consolidate the files between them). Each rank reports:

- its shard: the bytes of its local parameters;
- the growth of its peak resident memory (Linux's VmHWM, reset through /proc/self/clear_refs
  before each phase) over its resident memory before the phase: the load's, the save's.

The load's growth includes the shard itself (`to_empty` leaves its pages untouched until the
load writes them). The bound the figures are held to is 1.5 x the rank's shard + a fixed
buffer: the largest single tensor of the model (consolidation assembles one output tensor at
a time) plus one safetensors file (the reader maps one file at a time; the pages it touches
count as resident while it is open). The whole model is printed beside them. Figures and
ratios only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(phase):
    """(seconds, peak RSS growth in bytes) of `phase()`, from a reset high-water mark."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = rss_kib("VmRSS")
    started = time.perf_counter()
    phase()
    return time.perf_counter() - started, (rss_kib("VmHWM") - before) * 1024


def llama_args(cli):
    from titanlite.models.llama.model import LlamaArgs

    return LlamaArgs(
        dim=cli.dim,
        n_layers=cli.layers,
        n_heads=cli.dim // 64,
        n_kv_heads=cli.dim // 256,
        vocab_size=cli.vocab,
        multiple_of=256,
        max_seq_len=2048,
    )


def worker(rank: int, world: int, port: int, cli, folder: str, out: str) -> None:
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
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titanlite.checkpoint import hf_io
    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.config import Checkpoint
    from titanlite.models.llama import llama3_hf as hf_adapter, llama3_spec
    from titanlite.models.llama.model import Llama
    from titanlite.parallel.mesh import ParallelDims
    from titanlite.parallel.parallelize import parallelize

    args = llama_args(cli)
    with torch.device("meta"):
        model = Llama(args)
    if world > 1:
        parallelize(model, ParallelDims(1, world, 1, world).build_mesh("cpu").fsdp)
    model.to_empty(device="cpu")
    shard = sum(
        p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
        for p in model.parameters()
    )
    cfg = Checkpoint(enable_checkpoint=False, initial_load_path=str(Path(folder) / "hf"), initial_load_format="hf")
    manager = CheckpointManager(cfg, str(Path(out) / "run"), llama3_spec, "bench", args, model=model)
    load_s, load_peak = measure(manager.load)
    saved = Path(out) / f"saved-{world}"
    save_s, save_peak = measure(
        lambda: hf_io.save_hf_weights(
            get_model_state_dict(model),
            saved,
            hf_adapter,
            args,
            dist.group.WORLD if world > 1 else None,
            max_file_bytes=200 * 1024**2,
        )
    )
    rows = [None] * world
    dist.all_gather_object(rows, (rank, shard, load_s, load_peak, save_s, save_peak))
    if rank == 0:
        (Path(out) / f"result-{world}.txt").write_text(repr(rows))
    dist.barrier()
    dist.destroy_process_group()


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 4])
    cli = parser.parse_args()
    import transformers

    from tests.helpers.distributed import free_port
    from titanlite.models.llama import llama3_hf as hf_adapter

    args = llama_args(cli)
    work = Path(tempfile.mkdtemp(prefix="hf_io_bench-"))
    try:
        torch.manual_seed(0)
        source = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(hf_adapter.hf_config(args)))
        params = sum(p.numel() for p in source.parameters())
        largest = max(p.numel() * p.element_size() for p in source.parameters())
        source.save_pretrained(work / "hf", max_shard_size="200MB")
        del source
        files = len(list((work / "hf").glob("*.safetensors")))
        buffer = largest + max(p.stat().st_size for p in (work / "hf").glob("*.safetensors"))
        print(
            f"model: {params / 1e6:.1f}M parameters (dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads, "
            f"{args.kv_heads} kv heads, vocab {args.vocab_size}), float32: {mb(params * 4)} in {files} files by "
            f"transformers save_pretrained; fixed buffer {mb(buffer)} (largest tensor {mb(largest)} + largest file)"
        )
        for world in cli.procs:
            os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
            mp.start_processes(
                worker, args=(world, free_port(), cli, str(work), str(work)), nprocs=world, start_method="spawn"
            )
            for rank, shard, load_s, load_peak, save_s, save_peak in eval((work / f"result-{world}.txt").read_text()):
                bound = 1.5 * shard + buffer
                print(
                    f"procs {world} rank {rank}: shard {mb(shard)}; load {load_s:.1f} s, peak RSS +{mb(load_peak)} "
                    f"({load_peak / shard:.2f}x shard); save {save_s:.1f} s, peak RSS +{mb(save_peak)} "
                    f"({save_peak / shard:.2f}x shard); bound 1.5x shard + buffer = {mb(bound)}: "
                    f"{'within' if max(load_peak, save_peak) <= bound else 'OVER'}; whole model {mb(params * 4)}"
                )
            shutil.rmtree(work / f"saved-{world}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
