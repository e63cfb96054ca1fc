"""Parallel degrees and the device mesh: every degree check lives here.

The mesh is one named `DeviceMesh` over all ranks with dims ("dp_replicate", "dp_shard",
"tp") in that order (size-1 dims dropped), so tensor-parallel ranks are neighbours (the
fastest links) and FSDP shards across them. Data loading and loss averaging use "dp", the
flattened (dp_replicate, dp_shard) submesh; gradient norms are reduced over the whole mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.errors import TitanliteError


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        """Resolve `data_parallel_shard_degree = -1` and check the product against the world."""
        replicate = parallelism.data_parallel_replicate_degree
        shard = parallelism.data_parallel_shard_degree
        tp = parallelism.tensor_parallel_degree
        if shard == -1:
            if world_size % (replicate * tp):
                raise TitanliteError(
                    f"parallelism: world size {world_size} is not divisible by "
                    f"data_parallel_replicate_degree {replicate} x tensor_parallel_degree {tp}"
                )
            shard = world_size // (replicate * tp)
        if replicate > 1 and shard == 1:
            raise TitanliteError(
                "parallelism.data_parallel_replicate_degree: replication needs data_parallel_shard_degree > 1 "
                "(HSDP); for plain data parallelism set data_parallel_shard_degree instead"
            )
        if replicate * shard * tp != world_size:
            raise TitanliteError(
                f"parallelism: data_parallel_replicate_degree {replicate} x data_parallel_shard_degree {shard} "
                f"x tensor_parallel_degree {tp} = {replicate * shard * tp}, but the world size is {world_size}"
            )
        return cls(dp_replicate=replicate, dp_shard=shard, tp=tp, world_size=world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def check_model(self, tp_problems: list[str], seq_len: int) -> None:
        """Shapes that must split evenly across tp ranks (sequence parallel shards seq_len too)."""
        if not self.tp_enabled:
            return
        problems = list(tp_problems)
        if seq_len % self.tp:
            problems.append(f"training.seq_len {seq_len} is not divisible by tensor_parallel_degree {self.tp}")
        if problems:
            raise TitanliteError("parallelism.tensor_parallel_degree: " + "; ".join(problems))

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The named world mesh plus a flattened "dp" submesh; None for a single process."""
        if self.world_size == 1:
            return None
        dims = [(name, size) for name, size in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp)) if size > 1]
        mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        dp_names = tuple(name for name, _ in dims if name.startswith("dp_"))
        if len(dp_names) == 2:
            mesh[dp_names]._flatten("dp")
        return mesh

    @staticmethod
    def dp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The data-parallel submesh: "dp" (flattened) or the single dp dim present."""
        if mesh is None:
            return None
        names = mesh.mesh_dim_names
        if "dp_replicate" in names and "dp_shard" in names:
            return mesh["dp"]
        for name in ("dp_shard", "dp_replicate"):
            if name in names:
                return mesh[name]
        return None

    @staticmethod
    def fsdp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The mesh fully_shard gets: 2D (dp_replicate, dp_shard) means HSDP."""
        if mesh is None:
            return None
        names = tuple(n for n in ("dp_replicate", "dp_shard") if n in mesh.mesh_dim_names)
        return mesh[names] if names else None

    @staticmethod
    def tp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
        return mesh["tp"] if mesh is not None and "tp" in mesh.mesh_dim_names else None
