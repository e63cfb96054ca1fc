"""Parallel degrees and the device mesh: every degree check lives here.

The mesh is one named `DeviceMesh` over all ranks with dims ("pp", "dp_replicate",
"dp_shard", "cp", "tp") in that order (size-1 dims dropped), so tensor-parallel ranks are
neighbours (the fastest links), context-parallel ranks next (they all-gather keys and values
in every layer), FSDP shards across them, and pipeline stages, which only pass activations
to the next stage, are farthest apart. Data loading uses "dp", the flattened (dp_replicate,
dp_shard) submesh (every pipeline stage and cp rank of one dp rank reads the same batches);
FSDP shards over dp_shard x cp (cp ranks hold different tokens of the same model, like dp
ranks; with nothing to shard, dp_replicate alone is replicate-only data parallelism); the
loss is averaged over dp x cp; gradient norms are reduced over the whole mesh.
Expert parallelism adds no dim: its ep ranks are borrowed from dp_shard x cp, whose view is
unflattened into ("efsdp", "ep"), ep innermost (docs/parallelism.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.errors import TitanliteError
from titanlite.parallel.context_parallel import ContextParallel
from titanlite.parallel.distributed import adopt_groups

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first; each a degree of ParallelDims


@dataclass(frozen=True)
class ParallelDims:
    """The run's degrees, checked against each other and the world size (`from_config`)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        """Resolve `data_parallel_shard_degree = -1` and check the product against the world;
        ep ranks are data-parallel ranks (dp_shard x cp) that split the experts between them."""
        p = parallelism
        replicate, shard, tp = p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree
        pp, cp, ep = p.pipeline_parallel_degree, p.context_parallel_degree, p.expert_parallel_degree
        etp = getattr(p, "expert_tensor_parallel_degree", 1)
        with_pp = "".join(f" x {dim}_parallel_degree {n}" for dim, n in (("context", cp), ("pipeline", pp)) if n > 1)
        others = f"data_parallel_replicate_degree {replicate} x tensor_parallel_degree {tp}{with_pp}"
        model_ranks = tp * pp * cp
        if shard == -1:
            if world_size % (replicate * model_ranks):
                raise TitanliteError(f"parallelism: world size {world_size} is not divisible by {others}")
            shard = world_size // (replicate * model_ranks)
        if replicate * shard * model_ranks != world_size:
            raise TitanliteError(
                f"parallelism: data_parallel_replicate_degree {replicate} x data_parallel_shard_degree {shard} "
                f"x tensor_parallel_degree {tp}{with_pp} = {replicate * shard * model_ranks}, but the world size is "
                f"{world_size}"
            )
        if ep > 1 and (shard * cp) % ep:
            raise TitanliteError(
                f"parallelism.expert_parallel_degree: {ep} does not divide data_parallel_shard_degree {shard} "
                f"x context_parallel_degree {cp} = {shard * cp} (the ranks expert parallelism borrows)"
            )
        if etp not in (1, tp):
            raise TitanliteError(
                f"parallelism.expert_tensor_parallel_degree: {etp} must be 1 (experts whole on each tp rank) or "
                f"tensor_parallel_degree {tp} (experts split over the tp ranks)"
            )
        return cls(replicate, shard, tp, world_size, pp, cp, ep, etp)

    def check_experts(self, n_experts: list[int], model: str) -> None:
        """ep > 1 needs MoE layers (`n_experts`: each one's routed experts) whose experts it
        divides; etp > 1 needs MoE layers."""
        for key, degree in (("expert_tensor_parallel_degree", self.etp), ("expert_parallel_degree", self.ep)):
            if degree > 1 and not n_experts:
                raise TitanliteError(f"parallelism.{key}: {degree} needs a model with MoE layers; {model} has none")
        if uneven := sorted({n for n in n_experts if n % self.ep}):  # none at ep 1
            raise TitanliteError(
                f"parallelism.expert_parallel_degree: {self.ep} does not divide {model}'s {uneven[0]} experts per layer"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard x cp (and replicates over dp_replicate): it is what reduces
        the gradients of context-parallel ranks too."""
        return self.dp > 1 or self.cp > 1

    @property
    def replicate_only(self) -> bool:
        """dp_replicate > 1 with nothing sharded (dp_shard x cp = 1): whole weights on every
        rank and an all-reduce of gradients (composable `replicate`), not FSDP of degree 1."""
        return self.dp_replicate > 1 and self.dp_shard * self.cp == 1

    @property
    def etp_enabled(self) -> bool:
        """Each routed expert's weights split over tp (parallel/expert_tensor_parallel.py)."""
        return self.etp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def shards(self) -> int:
        """Ways one model's training state is split: FSDP shards (dp_shard x cp) x TP x pipeline stages."""
        return self.dp_shard * self.non_data_parallel_size

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that hold one data-parallel rank's model between them: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    @property
    def efsdp(self) -> int:
        """The experts' FSDP degree: the dp_shard x cp ranks left to each ep rank's experts."""
        return self.dp_shard * self.cp // self.ep

    def named_degrees(self) -> list[tuple[str, int]]:
        """The mesh dims, outermost first, size-1 ones dropped."""
        return [(name, getattr(self, name)) for name in MESH_DIMS if getattr(self, name) > 1]

    def check_model(self, tp_problems: list[str], seq_len: int) -> None:
        """Shapes that must split evenly across tp ranks (sequence parallel shards seq_len too)
        and cp ranks (2 x cp load-balanced chunks)."""
        if self.cp_enabled and seq_len % (2 * self.cp):
            raise TitanliteError(
                f"parallelism.context_parallel_degree: training.seq_len {seq_len} is not divisible by "
                f"2 x context_parallel_degree = {2 * self.cp} (each cp rank holds two chunks of the window)"
            )
        if not self.tp_enabled:
            return
        problems = list(tp_problems)
        if (seq_len // self.cp) % self.tp:
            local = f" (its {seq_len // self.cp}-token part on each cp rank)" if self.cp_enabled else ""
            problems.append(f"training.seq_len {seq_len}{local} is not divisible by tensor_parallel_degree {self.tp}")
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
        names = [name for name, _ in dims]
        world = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(names))

        def view(wanted: tuple[str, ...], flat_name: str) -> tuple[DeviceMesh | None, str | None]:
            """The present dims of `wanted` as one dim (flattened when several), and its name."""
            present = tuple(name for name in wanted if name in names)
            if len(present) < 2:
                return (world[present[0]], present[0]) if present else (None, None)
            return world[present]._flatten(flat_name), flat_name

        dp, _ = view(("dp_replicate", "dp_shard"), "dp")
        shard, shard_name = view(("dp_shard", "cp"), "dp_shard_cp")
        loss, _ = view(("dp_replicate", "dp_shard", "cp"), "dp_cp")
        fsdp = world[("dp_replicate", shard_name)] if "dp_replicate" in names and shard is not None else shard
        replicate = world["dp_replicate"] if self.replicate_only else None
        ep, expert_fsdp = self._expert_views(shard, fsdp) if self.ep_enabled else (None, None)
        views = (world, dp, shard, loss, ep, expert_fsdp)
        # the run's timeouts
        adopt_groups(group for mesh in views if mesh is not None for group in mesh.get_all_groups())
        present = {name: world[name] if name in names else None for name in ("tp", "pp", "cp")}
        return Meshes(world, dp, fsdp, loss=loss, ep=ep, expert_fsdp=expert_fsdp, replicate=replicate, **present)

    def _expert_views(self, shard: DeviceMesh, fsdp: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        """(ep, expert_fsdp): ep ranks neighbours within dp_shard x cp, efsdp the rest of them;
        with dp_replicate the experts' HSDP (replicated over it, sharded over efsdp)."""
        shape, split_names = (self.efsdp, self.ep), ("efsdp", "ep")
        if self.dp_replicate > 1:
            split = fsdp._unflatten(1, shape, split_names)
            expert_fsdp = split[("dp_replicate", "efsdp")]
        else:
            split = shard._unflatten(0, shape, split_names)
            expert_fsdp = split["efsdp"]
        return split["ep"], expert_fsdp


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the views of it each parallelism uses; None where a dim is absent.

    dp:   data loading: "dp" (flattened dp_replicate x dp_shard) or the one dp dim present.
    fsdp: what `fully_shard` gets: dp_shard x cp (flattened), with dp_replicate before it a
          2D mesh, which means HSDP.
    tp:   the tensor-parallel dim.
    pp:   the pipeline-parallel dim (stages pass activations along it).
    cp:   the context-parallel dim (the sequence split, keys and values all-gathered).
    loss: loss averaging: dp x cp (every rank that holds different tokens of one step).
    ep:   expert parallelism: the inner ep ranks of dp_shard x cp (one group splits the
          experts and exchanges tokens by all-to-all).
    expert_fsdp: what `fully_shard` of the experts gets: the outer (dp_shard x cp) / ep
          ranks, which hold the same experts ("efsdp"); with dp_replicate before it a 2-D
          mesh (the experts' HSDP), like `fsdp`.
    replicate: replicate-only data parallelism (dp_replicate with dp_shard x cp = 1), where
          `fsdp` is None: the weights stay whole and gradients are all-reduced over it.
    context_parallel: this rank's place on cp (None without it), built once per mesh: the
          model's attention (`parallelize`) and the step that cuts its batches to this rank's
          tokens (`step/builder.py`) share it.
    """

    world: DeviceMesh | None
    dp: DeviceMesh | None
    fsdp: DeviceMesh | None
    tp: DeviceMesh | None
    pp: DeviceMesh | None = None
    cp: DeviceMesh | None = None
    loss: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    expert_fsdp: DeviceMesh | None = None
    replicate: DeviceMesh | None = None

    @functools.cached_property
    def context_parallel(self) -> ContextParallel | None:
        return ContextParallel(self.cp) if self.cp is not None else None

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks (the batches it reads); 0 without dp."""
        return self.dp.get_local_rank() if self.dp is not None else 0

    @property
    def device_type(self) -> str:
        """The mesh's device type; without one (one process), the trainer's choice of device."""
        return self.world.device_type if self.world is not None else default_device_type()


def build_mesh(
    dp_replicate: int = 1,
    dp_shard: int = -1,
    cp: int = 1,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    device_type: str | None = None,
) -> Meshes:
    """The library's mesh: the trainer's named mesh and views from degrees (`dp_shard` -1 =
    the rest of the world), checked as the trainer checks its config. Every rank calls it,
    after `init_distributed`; one process gets a `Meshes` of None views."""
    degrees = SimpleNamespace(
        data_parallel_replicate_degree=dp_replicate,
        data_parallel_shard_degree=dp_shard,
        tensor_parallel_degree=tp,
        pipeline_parallel_degree=pp,
        context_parallel_degree=cp,
        expert_parallel_degree=ep,
    )
    for name, value in vars(degrees).items():
        if type(value) is not int or (value < 1 and (name, value) != ("data_parallel_shard_degree", -1)):
            raise TitanliteError(f"build_mesh: {name} must be a whole number >= 1 (dp_shard also -1), got {value!r}")
    dims = ParallelDims.from_config(degrees, dist.get_world_size() if dist.is_initialized() else 1)
    return dims.build_mesh(device_type or default_device_type())


def default_device_type() -> str:
    """One process's device when the caller names none: a GPU where there is one, as the trainer picks."""
    return "cuda" if torch.cuda.is_available() else "cpu"
