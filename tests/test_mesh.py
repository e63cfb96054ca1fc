"""Parallel degrees against the world size and the model, before any device is touched."""

from types import SimpleNamespace

import pytest

from titanlite.errors import TitanliteError
from titanlite.models.llama import llama3_spec
from titanlite.parallel.mesh import ParallelDims


def parallelism(replicate=1, shard=-1, tp=1):
    return SimpleNamespace(data_parallel_replicate_degree=replicate, data_parallel_shard_degree=shard, tensor_parallel_degree=tp)


def test_shard_degree_fills_the_world():
    dims = ParallelDims.from_config(parallelism(replicate=2, tp=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 2, 2, 4)


@pytest.mark.parametrize(
    "config, world, message",
    [
        (parallelism(tp=3), 4, "world size 4 is not divisible"),
        (parallelism(shard=2, tp=1), 4, "= 2, but the world size is 4"),
        (parallelism(replicate=2, shard=1), 2, "data_parallel_replicate_degree"),
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
