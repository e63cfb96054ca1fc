"""Parallel degrees against the world size and the model, before any device is touched."""

from types import SimpleNamespace

import pytest

from titanlite.errors import TitanliteError
from titanlite.models.llama import llama3_spec
from titanlite.parallel.mesh import ParallelDims


def parallelism(replicate=1, shard=-1, tp=1, ep=1, etp=1):
    return SimpleNamespace(
        expert_tensor_parallel_degree=etp,
        data_parallel_replicate_degree=replicate,
        data_parallel_shard_degree=shard,
        tensor_parallel_degree=tp,
        pipeline_parallel_degree=1,
        context_parallel_degree=1,
        expert_parallel_degree=ep,
    )


def test_shard_degree_fills_the_world():
    dims = ParallelDims.from_config(parallelism(replicate=2, tp=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 2, 2, 4)


@pytest.mark.parametrize(
    "config, world, message",
    [
        (parallelism(tp=3), 4, "world size 4 is not divisible"),
        (parallelism(shard=2, tp=1), 4, "= 2, but the world size is 4"),
        (
            parallelism(tp=2, ep=3),
            8,
            "expert_parallel_degree: 3 does not divide data_parallel_shard_degree 4 x context_parallel_degree 1 = 4",
        ),
        (
            parallelism(tp=2, etp=4),
            4,
            "expert_tensor_parallel_degree: 4 must be 1 .* or tensor_parallel_degree 2",
        ),
    ],
)
def test_degree_errors_name_the_numbers(config, world, message):
    with pytest.raises(TitanliteError, match=message):
        ParallelDims.from_config(config, world)


def test_model_shapes_must_split_across_tp():
    args = llama3_spec.args_for("debugmodel", vocab_size=4096)  # 8 heads, 4 kv heads
    dims = ParallelDims.from_config(parallelism(tp=8), 8)
    with pytest.raises(TitanliteError, match="n_kv_heads 4 is not divisible by tensor_parallel_degree 8"):
        dims.check_model(llama3_spec.tp_problems(args, 8), 256)
    dims = ParallelDims.from_config(parallelism(tp=2), 2)
    with pytest.raises(TitanliteError, match="training.seq_len 255 is not divisible"):
        dims.check_model(llama3_spec.tp_problems(args, 2), 255)
    dims.check_model(llama3_spec.tp_problems(args, 2), 256)


def test_global_batch_sets_the_accumulation_steps():
    dims = ParallelDims.from_config(parallelism(tp=2), 8)  # dp 4
    assert dims.grad_accum_steps(local_batch_size=2, global_batch_size=-1) == 1
    assert dims.grad_accum_steps(local_batch_size=2, global_batch_size=16) == 2
    with pytest.raises(
        TitanliteError, match="global_batch_size: 12 is not a multiple of local_batch_size 2 x data-parallel degree 4"
    ):
        dims.grad_accum_steps(local_batch_size=2, global_batch_size=12)


def test_one_process_has_no_meshes():
    meshes = ParallelDims.from_config(parallelism(), 1).build_mesh("cpu")
    assert (meshes.world, meshes.dp, meshes.fsdp, meshes.tp) == (None, None, None, None)


def test_meshes_of_hsdp_x_tp_on_a_fake_world():
    """Rank 5 of a (dp_replicate 2, dp_shard 2, tp 2) world, simulated on one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        meshes = ParallelDims.from_config(parallelism(replicate=2, tp=2), 8).build_mesh("cpu")
        assert meshes.world.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
        assert meshes.dp.size() == 4 and meshes.dp.get_local_rank() == 2  # rank 5 = (1, 0, 1)
        assert meshes.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert meshes.tp.size() == 2 and meshes.tp.get_local_rank() == 1
    finally:
        dist.destroy_process_group()


def test_replicate_only_gets_a_replicate_mesh_and_no_fsdp_one_on_a_fake_world():
    """dp_replicate 2 with dp_shard 1 (x tp 2): the weights stay whole (composable replicate
    over dp_replicate), so there is no FSDP mesh; HSDP keeps its 2-D FSDP mesh and no replicate one."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        dims = ParallelDims.from_config(parallelism(replicate=2, shard=1, tp=2), 4)
        assert dims.replicate_only and dims.shards == 2  # tp only: each rank holds half the model
        meshes = dims.build_mesh("cpu")
        assert meshes.fsdp is None and meshes.replicate.mesh.tolist() == [1, 3]
        assert meshes.dp.mesh.tolist() == [1, 3] and meshes.loss.mesh.tolist() == [1, 3]
        assert not ParallelDims.from_config(parallelism(replicate=2), 4).replicate_only
    finally:
        dist.destroy_process_group()


def test_ep_borrows_neighbouring_dp_shard_ranks_on_a_fake_world():
    """Rank 5 of a (dp_shard 4, tp 2) world at ep 2: its dp_shard rank 2 is ep rank 0 of
    dp_shard ranks {2, 3} (world ranks 5 and 7, its tp index), and holds the same experts as
    dp_shard rank 0 (world rank 1): the efsdp group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        meshes = ParallelDims.from_config(parallelism(tp=2, ep=2), 8).build_mesh("cpu")
        assert meshes.ep.mesh.tolist() == [5, 7] and meshes.ep.get_local_rank() == 0
        assert meshes.expert_fsdp.mesh.tolist() == [1, 5] and meshes.expert_fsdp.get_local_rank() == 1
        assert meshes.fsdp.mesh.tolist() == [1, 3, 5, 7]  # everything else: all of dp_shard
    finally:
        dist.destroy_process_group()


def test_ep_inside_hsdp_replicates_the_experts_over_dp_replicate_on_a_fake_world():
    """Rank 5 of a (dp_replicate 2, dp_shard 4) world at ep 2: it is dp_shard rank 1 of
    replica 1 (world ranks 4-7); ep pairs it with its neighbour (world rank 4), efsdp with the
    other rank of its replica at the same ep index (7), and the experts' FSDP mesh is 2-D,
    (dp_replicate, efsdp), which is HSDP: replica 0 holds the same experts on ranks 1 and 3."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        meshes = ParallelDims.from_config(parallelism(replicate=2, ep=2), 8).build_mesh("cpu")
        assert meshes.ep.mesh.tolist() == [4, 5] and meshes.ep.get_local_rank() == 1
        assert meshes.expert_fsdp.mesh_dim_names == ("dp_replicate", "efsdp")
        assert meshes.expert_fsdp.mesh.tolist() == [[1, 3], [5, 7]]
        assert meshes.fsdp.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        dist.destroy_process_group()


def test_ep_needs_moe_layers_whose_experts_it_divides():
    dims = ParallelDims.from_config(parallelism(ep=2), 4)
    with pytest.raises(
        TitanliteError, match="expert_parallel_degree: 2 needs a model with MoE layers; model x has none"
    ):
        dims.check_experts([], "model x")
    with pytest.raises(TitanliteError, match="expert_parallel_degree: 2 does not divide model x's 3 experts per layer"):
        dims.check_experts([8, 3], "model x")
    dims.check_experts([8, 8], "model x")


def test_etp_needs_moe_layers():
    dims = ParallelDims.from_config(parallelism(tp=2, etp=2), 2)
    assert dims.etp_enabled and not dims.ep_enabled
    with pytest.raises(
        TitanliteError, match="expert_tensor_parallel_degree: 2 needs a model with MoE layers; model x has none"
    ):
        dims.check_experts([], "model x")
    dims.check_experts([8, 8], "model x")
