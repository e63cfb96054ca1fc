"""parallel/fsdp1.py and fsdp1_options.py on a one-rank gloo group: FSDP1's arguments mapped
to FSDP2 (units from each kind of wrap policy, strategies, precision), every refused option
and bad value one line naming it, and the wrapper's FSDP1 methods (summon_full_params with
writeback, full and sharded state dicts, state_dict_type, no_sync, clip_grad_norm_). The
two-process runs are tests/runs/test_examples.py."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FSDPModule, MixedPrecision, ShardingStrategy,
                                    StateDictType)
from torch.distributed.fsdp.wrap import (CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy,
                                         transformer_auto_wrap_policy)
from torch.distributed.tensor import DTensor

from titanlite.errors import TitanliteError
from titanlite.parallel.fsdp1 import FullyShardedDataParallel as FSDP


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.mlp(torch.relu(self.attn(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Linear(4, 8), nn.ModuleList([Block(), Block()]), nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def one_rank_world(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the wrapper's default device: the gloo group's CPU
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def sharded(model):
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


@pytest.mark.parametrize("policy, units", [
    (None, []),
    (functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}), ["blocks.0", "blocks.1"]),
    (ModuleWrapPolicy({Block}), ["blocks.0", "blocks.1"]),
    ({Block, nn.Linear}, ["blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "blocks.1.attn", "blocks.1.mlp", "embed", "head"]),
    (lambda m: isinstance(m, Block), ["blocks.0", "blocks.1"]),
    (CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 2), ["head"]),
    (functools.partial(size_based_auto_wrap_policy, min_num_params=100), ["blocks.0", "blocks.1"]),
])
def test_each_kind_of_wrap_policy_picks_the_units_fsdp1_would(policy, units):
    model = net()
    FSDP(model, auto_wrap_policy=policy)
    assert sorted(sharded(model)) == sorted(["", *units])


def test_the_wrapper_trains_like_the_plain_model_and_names_parameters_as_it():
    plain, wrapped = net(), FSDP(net(), auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP", forward_prefetch=True,
                                 backward_prefetch=None, sync_module_states=True, use_orig_params=True, limit_all_gathers=False)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = torch.randn(3, 4)
    for model in (plain, wrapped):
        model(x).square().mean().backward()
    norm = wrapped.clip_grad_norm_(1e9)
    assert torch.allclose(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
    assert wrapped.head is wrapped.module.head  # attributes fall through, as in FSDP1


def test_summon_full_params_gives_whole_parameters_and_writes_edits_back():
    model = FSDP(net(), auto_wrap_policy={Block})
    with FSDP.summon_full_params(model):
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        model.module.head.bias.data.fill_(7.0)
    assert isinstance(model.module.head.bias, DTensor)
    assert torch.equal(model.module.head.bias.full_tensor(), torch.full((2,), 7.0))
    with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=True):
        model.module.head.bias.data.fill_(1.0)
    assert torch.equal(model.module.head.bias.full_tensor(), torch.full((2,), 7.0))


def test_full_and_sharded_state_dicts_round_trip():
    model = FSDP(net(), auto_wrap_policy={Block})
    full = model.state_dict()
    assert not any(isinstance(v, DTensor) for v in full.values())
    plain = Net()
    plain.load_state_dict(full)
    x = torch.randn(3, 4)
    assert torch.equal(plain(x), model(x))
    other = FSDP(net(seed=1), auto_wrap_policy={Block})
    other.load_state_dict(full)
    assert torch.equal(other(x), plain(x))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        shards = model.state_dict()
        assert all(isinstance(v, DTensor) for v in shards.values())
        model.load_state_dict(shards)
    assert model._state_dict_type == StateDictType.FULL_STATE_DICT


def test_no_sync_turns_gradient_reduction_off_inside_the_block():
    model = FSDP(net())
    seen = []
    model.module.set_requires_gradient_sync = lambda flag, **_: seen.append(flag)
    with model.no_sync():
        pass
    assert seen == [False, True]


def test_mixed_precision_and_offload_map_to_fsdp2():
    model = FSDP(net(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 cpu_offload=CPUOffload(offload_params=True))
    assert model.module.head.weight.dtype == torch.float32  # the sharded master weights
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, option", [
    ({"param_init_fn": lambda m: None}, "param_init_fn"),
    ({"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)}, "mixed_precision"),
    ({"mixed_precision": MixedPrecision(keep_low_precision_grads=True)}, "mixed_precision"),
    ({"mixed_precision": "bf16"}, "mixed_precision"),
    ({"sharding_strategy": "ZERO3"}, "sharding_strategy"),
    ({"fsdp_group_size": 3}, "fsdp_group_size"),
    ({"fsdp_group_size": 1, "sharding_strategy": ShardingStrategy.NO_SHARD}, "fsdp_group_size"),
    ({"process_group": (None, None)}, "process_group"),
    ({"backward_prefetch": "pre"}, "backward_prefetch"),
    ({"forward_prefetch": 1}, "forward_prefetch"),
    ({"cpu_offload": True}, "cpu_offload"),
    ({"reshard_after_forward": 0}, "reshard_after_forward"),
    ({"auto_wrap_policy": 5}, "auto_wrap_policy"),
    ({"auto_wrap_policy": {"Missing"}}, "auto_wrap_policy"),
    ({"ignored_modules": [], "ignored_states": []}, "ignored_states"),
])
def test_options_without_an_fsdp2_meaning_and_bad_values_are_one_line_naming_the_option(kwargs, option):
    with pytest.raises(TitanliteError) as caught:
        FSDP(net(), **kwargs)
    assert str(caught.value).startswith(option + ":") and "\n" not in str(caught.value)


def test_refused_method_arguments_are_one_line_too():
    model = FSDP(net())
    for call, option in [(lambda: model.clip_grad_norm_(1.0, norm_type=1), "clip_grad_norm_"),
                         (lambda: FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT), "state_dict_type"),
                         (lambda: model.load_state_dict({}, assign=True), "load_state_dict")]:
        with pytest.raises(TitanliteError, match=f"^{option}:"):
            call()
    with pytest.raises(TitanliteError, match="^summon_full_params:"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass


def test_ignored_modules_stay_unsharded_and_backward_prefetch_post_is_accepted():
    model = net()
    FSDP(model, ignored_modules=[model.head], backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    assert not isinstance(model.head.weight, DTensor) and isinstance(model.embed.weight, DTensor)


def test_titanlite_checkpoints_of_the_wrapper_hold_shards_not_gathered_tensors(tmp_path):
    from titanlite.checkpoint.checkpointer import Checkpointer
    from titanlite.parallel.state_dict import sharded_state_dict

    model = FSDP(net(), auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, async_mode="disabled") as checkpointer:
        state = checkpointer.state()
        assert all(isinstance(v, DTensor) for v in state["model"].values()) and "head.weight" in state["model"]
        checkpointer.save(1)
        assert checkpointer.load() == 1
    assert all(isinstance(v, DTensor) for v in sharded_state_dict(model).values())


def test_without_a_process_group_the_wrapper_says_so(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(TitanliteError, match="^FullyShardedDataParallel: no process group"):
        FSDP(net())
