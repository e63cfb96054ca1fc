"""Parallel degrees and the device mesh: every degree check lives here.

The mesh is one named `DeviceMesh` over all ranks with dims ("pp", "dp_replicate",
"dp_shard", "tp") in that order (size-1 dims dropped), so tensor-parallel ranks are
neighbours (the fastest links), FSDP shards across them, and pipeline stages, which only
pass activations to the next stage, are farthest apart. Data loading and loss averaging use
"dp", the flattened (dp_replicate, dp_shard) submesh (every pipeline stage of one dp rank
reads the same batches); gradient norms are reduced over the whole mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.errors import TitanliteError
from titanlite.parallel.distributed import adopt_groups


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        """Resolve `data_parallel_shard_degree = -1` and check the product against the world."""
        replicate = parallelism.data_parallel_replicate_degree
        shard = parallelism.data_parallel_shard_degree
        tp = parallelism.tensor_parallel_degree
        pp = parallelism.pipeline_parallel_degree
        with_pp = f" x pipeline_parallel_degree {pp}" if pp > 1 else ""
        others = f"data_parallel_replicate_degree {replicate} x tensor_parallel_degree {tp}{with_pp}"
        if shard == -1:
            if world_size % (replicate * tp * pp):
                raise TitanliteError(f"parallelism: world size {world_size} is not divisible by {others}")
            shard = world_size // (replicate * tp * pp)
        if replicate > 1 and shard == 1:
            raise TitanliteError(
                "parallelism.data_parallel_replicate_degree: replication needs data_parallel_shard_degree > 1 "
                "(HSDP); for plain data parallelism set data_parallel_shard_degree instead"
            )
        if replicate * shard * tp * pp != world_size:
            raise TitanliteError(
                f"parallelism: data_parallel_replicate_degree {replicate} x data_parallel_shard_degree {shard} "
                f"x tensor_parallel_degree {tp}{with_pp} = {replicate * shard * tp * pp}, but the world size is {world_size}"
            )
        return cls(dp_replicate=replicate, dp_shard=shard, tp=tp, world_size=world_size, pp=pp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def shards(self) -> int:
        """Ways one model's training state is split: FSDP shards x TP x pipeline stages."""
        return self.dp_shard * self.tp * self.pp

    def named_degrees(self) -> list[tuple[str, int]]:
        """The mesh dims, outermost first, size-1 ones dropped."""
        dims = (("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp))
        return [(name, size) for name, size in dims if size > 1]

    def check_model(self, tp_problems: list[str], seq_len: int) -> None:
        """Shapes that must split evenly across tp ranks (sequence parallel shards seq_len too)."""
        if not self.tp_enabled:
            return
        problems = list(tp_problems)
        if seq_len % self.tp:
            problems.append(f"training.seq_len {seq_len} is not divisible by tensor_parallel_degree {self.tp}")
        if problems:
            raise TitanliteError("parallelism.tensor_parallel_degree: " + "; ".join(problems))

    def grad_accum_steps(self, local_batch_size: int, global_batch_size: int) -> int:
        """Microbatches per optimizer step: the global batch over what one pass of every
        data-parallel rank covers (-1 = one pass, no accumulation)."""
        per_microstep = local_batch_size * self.dp
        if global_batch_size == -1:
            return 1
        if global_batch_size % per_microstep:
            raise TitanliteError(
                f"training.global_batch_size: {global_batch_size} is not a multiple of local_batch_size "
                f"{local_batch_size} x data-parallel degree {self.dp}"
            )
        return global_batch_size // per_microstep

    def build_mesh(self, device_type: str) -> Meshes:
        """The named world mesh and the submeshes each parallelism uses (all None for one process)."""
        if self.world_size == 1:
            return Meshes(None, None, None, None)
        dims = self.named_degrees()
        world = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        dp_names = tuple(name for name, _ in dims if name.startswith("dp_"))
        if len(dp_names) == 2:
            dp = world[dp_names]._flatten("dp")
        else:
            dp = world[dp_names[0]] if dp_names else None
        adopt_groups([*world.get_all_groups(), dp.get_group() if dp is not None else None])  # the run's timeouts
        return Meshes(
            world=world,
            dp=dp,
            fsdp=world[dp_names] if dp_names else None,
            tp=world["tp"] if self.tp_enabled else None,
            pp=world["pp"] if self.pp_enabled else None,
        )


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the views of it each parallelism uses; None where a dim is absent.

    dp:   data loading and loss averaging: "dp" (flattened dp_replicate x dp_shard) or the
          one dp dim present.
    fsdp: what `fully_shard` gets: (dp_replicate, dp_shard) is 2D, which means HSDP.
    tp:   the tensor-parallel dim.
    pp:   the pipeline-parallel dim (stages pass activations along it).
    """

    world: DeviceMesh | None
    dp: DeviceMesh | None
    fsdp: DeviceMesh | None
    tp: DeviceMesh | None
    pp: DeviceMesh | None = None
