"""titanlite.compat.fsdp1 on a one-rank gloo group: FSDP1's arguments mapped to FSDP2 (units
from each kind of wrap policy, v1.12's keyword included), every refused option and bad value
one line naming it, and FSDP1's methods (apply, summon_full_params, the three state-dict types,
the optimizer-state helpers, fsdp_modules). What needs several ranks (strategies, prefetch,
reshard, no_sync, sync_module_states) is in tests/runs/test_parallel_equivalence.py (nested prefetch
and clipping with ignored modules in tests/runs/test_compat_ranks.py); the v1.12
page's own program in examples/fsdp1_style.py (tests/runs/test_examples.py)."""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import titanlite
from tests.helpers.small_nets import Block, Net, net, one_rank_group
from titanlite.compat import fsdp1
from titanlite.compat.fsdp1 import (
    BackwardPrefetch,
    CPUOffload,
    CustomPolicy,
    FullOptimStateDictConfig,
    MixedPrecision,
    ModuleWrapPolicy,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictType,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from titanlite.compat.fsdp1 import FullyShardedDataParallel as FSDP
from titanlite.errors import TitanliteError


@pytest.fixture(autouse=True)
def one_rank_world(monkeypatch):
    with one_rank_group(monkeypatch):
        yield


def sharded(model):
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def v1_12_policy(module, recurse, unwrapped_params, min_num_params=int(1e8)):
    """The v1.12 page's custom policy, with its keyword `unwrapped_params`."""
    return unwrapped_params >= min_num_params


@pytest.mark.parametrize(
    "policy, units",
    [
        (None, []),
        (functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}), ["blocks.0", "blocks.1"]),
        (ModuleWrapPolicy({Block}), ["blocks.0", "blocks.1"]),
        (
            {Block, nn.Linear},
            ["blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "blocks.1.attn", "blocks.1.mlp", "embed", "head"],
        ),
        (lambda m: isinstance(m, Block), ["blocks.0", "blocks.1"]),
        (CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 2), ["head"]),
        (functools.partial(size_based_auto_wrap_policy, min_num_params=100), ["blocks.0", "blocks.1"]),
        (functools.partial(v1_12_policy, min_num_params=100), ["blocks.0", "blocks.1"]),
    ],
)
def test_each_kind_of_wrap_policy_picks_the_units_fsdp1_would(policy, units):
    model = net()
    FSDP(model, auto_wrap_policy=policy)
    assert sorted(sharded(model)) == sorted(["", *units])


def test_the_import_line_is_the_only_change():
    """The names FSDP1 code imports beside the class come from the same line; the package's
    own export is this class."""
    assert all(hasattr(fsdp1, name) for name in fsdp1.__all__)
    assert titanlite.FullyShardedDataParallel is FSDP


def test_the_wrapper_trains_like_the_plain_model_and_names_parameters_as_it():
    plain, wrapped = (
        net(),
        FSDP(
            net(),
            auto_wrap_policy={Block},
            sharding_strategy="SHARD_GRAD_OP",
            forward_prefetch=True,
            backward_prefetch=None,
            sync_module_states=True,
            use_orig_params=True,
            limit_all_gathers=False,
        ),
    )
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = torch.randn(3, 4)
    for model in (plain, wrapped):
        model(x).square().mean().backward()
    norm = wrapped.clip_grad_norm_(1e9)
    assert torch.allclose(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
    assert wrapped.head is wrapped.module.head  # attributes fall through, as in FSDP1


def test_backward_prefetch_and_forward_prefetch_map_to_the_plan():
    """Which prefetch each setting asks for (tests/runs sees the all-gathers themselves)."""
    assert FSDP(net())._plan.backward_prefetch == "default"
    assert FSDP(net(), backward_prefetch=BackwardPrefetch.BACKWARD_POST)._plan.backward_prefetch == "default"
    assert FSDP(net(), backward_prefetch=None)._plan.backward_prefetch == "off"
    assert FSDP(net(), forward_prefetch=True)._plan.forward_prefetch


def test_apply_runs_on_whole_parameters_and_writes_them_back():
    model, seen = FSDP(net(), auto_wrap_policy={Block}), []

    def init(module):
        if isinstance(module, nn.Linear):
            seen.append(type(module.weight))
            nn.init.constant_(module.weight, 0.5)

    assert model.apply(init) is model
    assert seen and all(kind is nn.Parameter for kind in seen)  # whole tensors, not DTensor shards
    assert torch.equal(model.module.head.weight.full_tensor(), torch.full((2, 8), 0.5))


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


def test_full_sharded_and_local_state_dicts_round_trip():
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
    for kind in (StateDictType.LOCAL_STATE_DICT,):
        with FSDP.state_dict_type(other, kind):
            local = {k: v.clone() for k, v in other.state_dict().items()}
            assert not any(isinstance(v, DTensor) for v in local.values())
        fresh = FSDP(net(seed=2), auto_wrap_policy={Block})
        previous = FSDP.set_state_dict_type(fresh, kind)
        fresh.load_state_dict(local)
        assert previous.state_dict_type == StateDictType.FULL_STATE_DICT
        assert torch.equal(fresh(x), plain(x))
    assert FSDP.get_state_dict_type(model).state_dict_type == StateDictType.FULL_STATE_DICT


def test_fsdp_modules_are_the_wrappers_and_the_units_inside():
    model = FSDP(net(), auto_wrap_policy={Block})
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    assert FSDP.fsdp_modules(model) == [model, model.module.blocks[0], model.module.blocks[1]]


def test_a_wrapper_built_inside_another_first_nests_as_in_fsdp1():
    model = net()
    model.blocks[0] = FSDP(model.blocks[0])
    outer = FSDP(model)
    x = torch.randn(3, 4)
    outer(x).sum().backward()
    assert [n for n, _ in outer.named_parameters()] == [n for n, _ in Net().named_parameters()]
    plain = Net()
    plain.load_state_dict(outer.state_dict())
    assert torch.allclose(plain(x), outer(x))
    assert FSDP.fsdp_modules(outer, root_only=True) == [outer] and len(FSDP.fsdp_modules(outer)) == 3


def trained_pair():
    """A wrapped and a plain model with their AdamW after the same two steps."""
    pairs = []
    for wrap in (True, False):
        model = FSDP(net(), auto_wrap_policy={Block}) if wrap else net()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optim.step()
            optim.zero_grad()
        pairs.append((model, optim))
    return pairs


def assert_same_state(a, b):
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for key, values in a["state"].items():
        for name, value in values.items():
            left = value.full_tensor() if isinstance(value, DTensor) else value
            right = b["state"][key][name]
            assert torch.allclose(left, right.full_tensor() if isinstance(right, DTensor) else right, atol=1e-7), (
                key,
                name,
            )


def test_full_optim_state_dict_is_the_plain_optimizers_keyed_by_name_and_loads_back_every_way():
    (model, optim), (plain, plain_optim) = trained_pair()
    full = FSDP.full_optim_state_dict(model, optim)
    assert list(full["state"])[:2] == ["embed.weight", "embed.bias"]
    by_name = FSDP.rekey_optim_state_dict(plain_optim.state_dict(), OptimStateKeyType.PARAM_NAME, plain)
    assert_same_state(full, by_name)
    plain_optim.load_state_dict(FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, plain))
    for loaded in (
        FSDP.shard_full_optim_state_dict(full, model),
        FSDP.scatter_full_optim_state_dict(full, model),
        FSDP.optim_state_dict_to_load(model, optim, FSDP.optim_state_dict(model, optim)),
    ):
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fresh.load_state_dict(loaded)
        assert all(isinstance(v, DTensor) for s in fresh.state.values() for k, v in s.items() if k != "step")
        assert_same_state(FSDP.rekey_optim_state_dict(fresh.state_dict(), OptimStateKeyType.PARAM_NAME, model), full)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = FSDP.optim_state_dict(model, optim)
        assert isinstance(sharded["state"]["head.weight"]["exp_avg"], DTensor)
        FSDP.optim_state_dict_to_load(model, optim, sharded, load_directly=True)
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=FullOptimStateDictConfig(rank0_only=True)
    ):
        assert_same_state(FSDP.optim_state_dict(model, optim), full)


def test_two_optimizers_resumed_from_one_checkpoint_keep_their_own_step():
    """`Optimizer.load_state_dict` keeps the step tensor it is given and steps it in place:
    each loadable state holds its own."""
    (model, optim), _ = trained_pair()
    full = FSDP.full_optim_state_dict(model, optim)
    first, second = (torch.optim.AdamW(model.parameters(), lr=1e-2) for _ in range(2))
    first.load_state_dict(FSDP.shard_full_optim_state_dict(full, model))
    second.load_state_dict(FSDP.scatter_full_optim_state_dict(full, model))
    model(torch.randn(3, 4)).sum().backward()
    first.step()
    assert [s["step"].item() for s in second.state.values()] == [2.0] * len(second.state)


def test_mixed_precision_and_offload_map_to_fsdp2():
    model = FSDP(
        net(),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        cpu_offload=CPUOffload(offload_params=True),
    )
    assert model.module.head.weight.dtype == torch.float32  # the sharded master weights
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"param_init_fn": lambda m: None}, "param_init_fn"),
        (
            {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)},
            "mixed_precision",
        ),
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
        ({"reshard_after_forward": 2}, "reshard_after_forward"),  # 2 ranks do not divide a world of one
        ({"auto_wrap_policy": 5}, "auto_wrap_policy"),
        ({"auto_wrap_policy": {"Missing"}}, "auto_wrap_policy"),
        ({"ignored_modules": [], "ignored_states": []}, "ignored_states"),
    ],
)
def test_options_without_an_fsdp2_meaning_and_bad_values_are_one_line_naming_the_option(kwargs, option):
    with pytest.raises(TitanliteError) as caught:
        FSDP(net(), **kwargs)
    assert str(caught.value).startswith(option + ":") and "\n" not in str(caught.value)


def test_refused_method_arguments_are_one_line_too():
    model = FSDP(net())
    optim = torch.optim.AdamW(model.parameters())
    for call, option in [
        (lambda: model.clip_grad_norm_(1.0, norm_type=1), "clip_grad_norm_"),
        (lambda: FSDP.set_state_dict_type(model, "FULL"), "state_dict_type"),
        (lambda: model.load_state_dict({}, assign=True), "load_state_dict"),
        (lambda: FSDP.optim_state_dict_to_load(model, optim, {}, is_named_optimizer=True), "optim_state_dict_to_load"),
        (lambda: FSDP.rekey_optim_state_dict({"state": {}, "param_groups": []}, "ids", model), "optim_state_key_type"),
        (lambda: FSDP.get_state_dict_type(Net()), "get_state_dict_type"),
    ]:
        with pytest.raises(TitanliteError, match=f"^{option}:"):
            call()
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        with pytest.raises(TitanliteError, match="^optim_state_dict:"):
            FSDP.optim_state_dict(model, optim)
    with pytest.raises(TitanliteError, match="^summon_full_params:"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        with pytest.raises(TitanliteError, match="^load_state_dict: .*layout"):
            model.load_state_dict({k: torch.zeros(1) for k in model.state_dict()})


def test_ignored_modules_stay_unsharded():
    model = net()
    FSDP(model, ignored_modules=[model.head])
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
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(TitanliteError, match="^FullyShardedDataParallel: no process group"):
        FSDP(net())


def test_params_with_grad_is_v1_12s_property():
    model = FSDP(net(), auto_wrap_policy={Block})
    assert model.params_with_grad == []
    model(torch.randn(3, 4)).sum().backward()
    model.module.head.bias.grad = None
    assert model.params_with_grad == [p for n, p in model.named_parameters() if n != "head.bias"]


def test_scatter_full_optim_state_dict_takes_v1_12s_group_fourth():
    """v1.12: scatter_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, group=None)."""
    import torch.distributed as dist

    (model, optim), _ = trained_pair()
    full = FSDP.full_optim_state_dict(model, optim)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(FSDP.scatter_full_optim_state_dict(full, model, None, dist.group.WORLD))
    assert_same_state(FSDP.rekey_optim_state_dict(fresh.state_dict(), OptimStateKeyType.PARAM_NAME, model), full)
    with pytest.raises(TitanliteError, match="^optim: "):
        FSDP.scatter_full_optim_state_dict(full, model, None, "optimizer", dist.group.WORLD)


class NormNet(nn.Module):
    """Linear -> BatchNorm -> Linear: the MixedPrecision page's case for keeping BatchNorm out of it."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.mid, self.out = (
            nn.Linear(4, 16),
            nn.BatchNorm1d(16),
            nn.Linear(16, 16),
            nn.Linear(16, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.norm(self.inp(x))))))


def test_batch_norm_units_stay_out_of_mixed_precision_and_the_pages_combination_trains():
    """MixedPrecision(bf16 params, fp32 reduce) with a size-based policy: each BatchNorm is a
    unit of its own in float32 (its input cast up, its output back), the rest computes in
    bf16, and training follows the float32 model to bf16's precision."""
    torch.manual_seed(0)
    plain = NormNet()
    torch.manual_seed(0)
    model = NormNet()
    wrapped = FSDP(
        model,
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=200),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    assert sorted(sharded(model)) == ["", "mid", "norm"]  # norm (32 parameters) by the page's rule
    seen = {}
    for name in ("norm", "mid"):
        module = getattr(model, name)  # the weight as forward sees it, the input and output as they pass
        module.register_forward_pre_hook(
            lambda m, args, name=name: seen.update({name: [m.weight.dtype, args[0].dtype]})
        )
        module.register_forward_hook(lambda m, args, out, name=name: seen[name].append(out.dtype))
    losses = {}
    for key, net_ in (("plain", plain), ("wrapped", wrapped)):
        optim = torch.optim.AdamW(net_.parameters(), lr=1e-2)
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            loss = net_(x).float().square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.setdefault(key, []).append(loss.item())
    assert seen["norm"] == [torch.float32, torch.float32, torch.bfloat16]  # computed in fp32, handed on in bf16
    assert seen["mid"] == [torch.bfloat16, torch.bfloat16, torch.bfloat16]
    assert losses["wrapped"] == pytest.approx(losses["plain"], rel=3e-2)
    unwrapped = NormNet()
    FSDP(unwrapped, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    assert sharded(unwrapped) == [""]  # without an auto_wrap_policy the rule does nothing, as in FSDP1
