"""titanlite.compat.megatron on a one-rank gloo group: Megatron-core's constructor, the
units it shards (`sub_modules_to_wrap`, `_fsdp_modules`, transformer_impl "local"), the only
config attributes it reads (from megatron-core's own config classes and from plain stand-ins),
parameter attributes kept through sharding, and `_BaseDataParallel`'s methods. The Megatron-style
program is examples/megatron_style.py (tests/runs/test_examples.py); megatron-core's real GPTModel
on 2 ranks in tests/runs/test_compat_ranks.py."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.helpers.small_nets import Block, net, one_rank_group
from titanlite.compat.megatron import MEGATRON_DEFAULT_SUB_MODULES, TorchFullyShardedDataParallel


@pytest.fixture(autouse=True)
def one_rank_world(monkeypatch):
    with one_rank_group(monkeypatch):
        yield


def units(wrapper):
    return sorted(n for n, m in wrapper.module.named_modules() if n and isinstance(m, FSDPModule))


def stand_in(**config):
    return SimpleNamespace(**{"transformer_impl": "transformer_engine", "recompute_granularity": None, **config})


def test_the_constructor_is_megatrons():
    parameters = inspect.signature(TorchFullyShardedDataParallel).parameters
    assert list(parameters) == [
        "config",
        "ddp_config",
        "module",
        "sub_modules_to_wrap",
        "disable_bucketing",
        "process_group",
    ]
    assert parameters["sub_modules_to_wrap"].default is MEGATRON_DEFAULT_SUB_MODULES


def test_sub_modules_to_wrap_and_fsdp_modules_choose_the_units():
    model = net()
    model.blocks[1]._fsdp_modules = [nn.Linear]  # Megatron: a submodule names more classes to shard
    wrapper = TorchFullyShardedDataParallel(stand_in(), SimpleNamespace(), model, sub_modules_to_wrap={Block})
    assert units(wrapper) == [
        "blocks.0",
        "blocks.0.attn",
        "blocks.0.mlp",
        "blocks.1",
        "blocks.1.attn",
        "blocks.1.mlp",
        "embed",
        "head",
    ]
    assert (
        units(TorchFullyShardedDataParallel(stand_in(), SimpleNamespace(), net())) == []
    )  # Megatron's own classes: none here


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("one", ["Block", Block], ids=["name", "class"])
def test_one_class_or_class_name_is_that_class_not_its_letters(one, impl):
    """`sub_modules_to_wrap="Block"` (a string where a set is expected) is not split into characters."""
    wrapper = TorchFullyShardedDataParallel(stand_in(transformer_impl=impl), SimpleNamespace(), net(), one)
    assert units(wrapper) == ["blocks.0", "blocks.1"]


class ColumnParallelLinear(nn.Linear):
    """Named as Megatron's: the class its "local" transformer_impl leaves out of the set."""


def test_transformer_impl_local_leaves_column_parallel_linear_out():
    for impl, expected in (
        ("local", ["blocks.0", "blocks.1"]),
        ("transformer_engine", ["blocks.0", "blocks.1", "head"]),
    ):
        model = net()
        model.head = ColumnParallelLinear(8, 2)
        wrapper = TorchFullyShardedDataParallel(
            stand_in(transformer_impl=impl), SimpleNamespace(), model, sub_modules_to_wrap={Block, ColumnParallelLinear}
        )
        assert units(wrapper) == expected, impl


def test_megatron_cores_own_config_objects_and_stand_ins_both_work():
    megatron = pytest.importorskip("megatron.core")  # in the test extra
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert megatron is not None
    config = TransformerConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    for ddp_config, reshard in (
        (TorchFullyShardedDataParallelConfig(reshard_after_forward=False), False),
        (SimpleNamespace(reshard_after_forward=False), False),
        (SimpleNamespace(), True),
    ):
        wrapper = TorchFullyShardedDataParallel(config, ddp_config, net(), sub_modules_to_wrap={Block})
        assert wrapper._plan.reshard_after_forward == reshard and wrapper._plan.backward_prefetch == "previous"
        assert wrapper.config is config and wrapper.ddp_config is ddp_config
    assert TorchFullyShardedDataParallel(stand_in(), SimpleNamespace(), net())._plan.backward_prefetch == "default"


def test_parameter_attributes_survive_sharding():
    model = net()
    model.head.weight.tensor_model_parallel, model.head.weight.partition_dim = True, 0
    wrapper = TorchFullyShardedDataParallel(stand_in(), SimpleNamespace(), model, sub_modules_to_wrap={Block})
    assert isinstance(wrapper.module.head.weight, DTensor)
    assert wrapper.module.head.weight.tensor_model_parallel is True and wrapper.module.head.weight.partition_dim == 0


def test_the_base_data_parallel_methods():
    wrapper = TorchFullyShardedDataParallel(stand_in(), SimpleNamespace(), net(), sub_modules_to_wrap={Block})
    x = torch.randn(3, 4)
    wrapper(x).sum().backward()
    before = {n: p.grad.full_tensor().clone() for n, p in wrapper.named_parameters()}
    wrapper.scale_gradients(0.5)
    assert all(torch.allclose(p.grad.full_tensor(), before[n] * 0.5) for n, p in wrapper.named_parameters())
    wrapper.start_grad_sync()
    wrapper.finish_grad_sync()
    wrapper.broadcast_params()
    wrapper.zero_grad_buffer()
    assert all(p.grad is None for p in wrapper.parameters())
    state = wrapper.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values())
    assert wrapper.state_dict_for_save_checkpoint().keys() == state.keys()
    other = TorchFullyShardedDataParallel(stand_in(), SimpleNamespace(), net(seed=1), sub_modules_to_wrap={Block})
    other.load_state_dict(state)  # sharded, as DCP loads it
    assert torch.equal(other(x), wrapper(x))
    whole = {k: v.full_tensor() for k, v in state.items()}
    third = TorchFullyShardedDataParallel(stand_in(), SimpleNamespace(), net(seed=2), sub_modules_to_wrap={Block})
    third.load_state_dict(whole)
    assert torch.equal(third(x), wrapper(x))


class BiasHandingLinear(ColumnParallelLinear):
    """Megatron's skip_bias_add (the local spec's linear_fc1): the layer returns its bias for
    the caller to add."""

    skip_bias_add = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.linear(x, self.weight), self.bias


class BiasAddingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = ColumnParallelLinear(8, 8), BiasHandingLinear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.mlp(torch.relu(self.attn(x)))
        return x + out + bias


def test_a_layer_that_hands_out_its_bias_stays_in_its_parents_unit_and_finish_grad_sync_takes_megatrons_keyword():
    """As a unit of its own, the layer's bias would be read after that unit resharded it (a
    segfault on CPU); in its parent's unit it trains like the plain model."""
    plain, model = net(), net()
    for m in (plain, model):
        torch.manual_seed(1)
        m.blocks = nn.ModuleList([BiasAddingBlock(), BiasAddingBlock()])
    wrapper = TorchFullyShardedDataParallel(
        stand_in(), SimpleNamespace(), model, sub_modules_to_wrap={BiasAddingBlock, ColumnParallelLinear}
    )
    assert units(wrapper) == ["blocks.0", "blocks.0.attn", "blocks.1", "blocks.1.attn"]
    x = torch.randn(3, 4)
    for m in (plain, wrapper):
        m(x).square().mean().backward()
    wrapper.finish_grad_sync(force_all_reduce=True)  # as megatron-core's finalize_model_grads calls it
    grads = dict(plain.named_parameters())
    assert all(torch.allclose(p.grad.full_tensor(), grads[n].grad) for n, p in wrapper.named_parameters())
