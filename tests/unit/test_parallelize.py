"""parallel/parallelize.py (and units.py) on one process and a one-rank gloo mesh: blocks and
FSDP units chosen by names, classes or a predicate, AC wrapping each k-th block, a TP plan
refused without a tp mesh, every bad setting one line; build_mesh's checks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from titanlite.errors import TitanliteError
from titanlite.parallel.mesh import build_mesh
from titanlite.parallel.parallelize import parallelize


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return x + self.inner(x)


class Net(nn.Module):
    """A user's model: blocks in a ModuleList under another name than `layers`."""

    def __init__(self):
        super().__init__()
        self.stack = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        for block in self.stack:
            x = block(x)
        return x


def test_ac_every_second_block_chosen_by_class_keeps_names_and_outputs():
    torch.manual_seed(0)
    model, reference = Net(), None
    reference = Net()
    reference.load_state_dict(model.state_dict())
    parallelize(model, None, blocks={Block}, ac=2)
    assert [type(b).__name__ for b in model.stack] == ["Block", "CheckpointWrapper", "Block", "CheckpointWrapper"]
    x = torch.randn(2, 4)
    assert torch.equal(model(x), reference(x))


def test_per_op_ac_wraps_every_outermost_block_not_its_inner_modules():
    model = parallelize(Net(), None, blocks=lambda m: isinstance(m, (Block, Inner)), ac="op")
    assert all(isinstance(b, CheckpointWrapper) for b in model.stack)
    assert not any(
        isinstance(m, CheckpointWrapper) for b in model.stack for m in b._checkpoint_wrapped_module.modules()
    )


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_nested_fsdp_units_by_class_name_and_prefetch(one_rank_world):
    model = Net()
    parallelize(
        model,
        init_device_mesh("cpu", (1,)),
        blocks={Block},
        fsdp_modules=["Block", "Inner"],
        prefetch=2,
        reshard_after_forward=True,
    )
    sharded = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
    assert sharded == ["", *sorted(f"stack.{i}{s}" for i in range(4) for s in ("", ".inner"))]
    model(torch.randn(2, 4)).sum().backward()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ac": "some"}, "ac must be"),
        ({"ac": 0}, "ac must be"),
        ({"ac": "full"}, "ac and compile wrap blocks"),
        ({"prefetch": -1}, "prefetch must be"),
        ({"reshard_after_forward": "sometimes"}, "reshard_after_forward must be"),
        ({"tp_plan": {"stack.0.inner.proj": None}}, "tp_plan needs a mesh"),
        ({"blocks": ["Missing"]}, "blocks: no module of class Missing"),
        ({"blocks": [3]}, "blocks: expected module classes"),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    class NoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)

    with pytest.raises(TitanliteError, match=f"^parallelize: {message}"):
        parallelize(NoLayers(), None, **kwargs)


def test_an_int_reshard_must_divide_the_shards(one_rank_world, monkeypatch):
    mesh = init_device_mesh("cpu", (1,))
    monkeypatch.setattr(type(mesh), "size", lambda self, dim=None: 4)
    with pytest.raises(TitanliteError, match="^parallelize: reshard_after_forward 3 ranks do not divide the 4"):
        parallelize(Net(), mesh, blocks={Block}, reshard_after_forward=3)


def test_build_mesh_checks_degrees_and_gives_none_views_on_one_process():
    meshes = build_mesh()
    assert meshes.fsdp is None and meshes.tp is None
    with pytest.raises(TitanliteError, match="^build_mesh: tensor_parallel_degree"):
        build_mesh(tp=0)
    with pytest.raises(TitanliteError, match="but the world size is 1"):
        build_mesh(dp_shard=2)


def test_fsdp_shards_a_tensor_with_fewer_rows_than_ranks_along_a_later_dim_it_divides():
    """More ranks than experts (128 over 512): a stacked expert weight is split along a later
    dim every rank gets an equal block of; dim 0 otherwise, and wherever no later dim divides
    evenly (FSDP2 allows uneven shards on dim 0 only)."""
    from torch.distributed.tensor import Shard

    from titanlite.parallel.fsdp import shard_dim

    place = shard_dim(4)
    assert place(torch.nn.Parameter(torch.empty(3, 24, 32))) == Shard(1)
    assert place(torch.nn.Parameter(torch.empty(3, 6, 32))) == Shard(2)
    assert place(torch.nn.Parameter(torch.empty(3, 5, 7))) is None
    assert (
        place(torch.nn.Parameter(torch.empty(8, 6, 32))) is None and place(torch.nn.Parameter(torch.empty(3))) is None
    )
