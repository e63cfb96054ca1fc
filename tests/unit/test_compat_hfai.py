"""titanlite.compat.hfai on a one-rank gloo group: hfai's signature and defaults (reshard
after forward, no backward prefetch), its state-dict semantics (whole inside the instance's
`summon_full_params()`, per-rank local outside), and its refusals. The documented program is
examples/hfai_style.py (tests/runs/test_examples.py); strategies and prefetch on 4 ranks in
tests/runs/test_parallel_equivalence.py."""

import inspect

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.helpers.small_nets import Block, Net, net, one_rank_group
from titanlite.compat import hfai
from titanlite.compat.hfai import FullyShardedDataParallel as FSDP
from titanlite.errors import TitanliteError


@pytest.fixture(autouse=True)
def one_rank_world(monkeypatch):
    with one_rank_group(monkeypatch):
        yield


def test_the_signature_and_defaults_are_hfais():
    parameters = inspect.signature(FSDP).parameters
    assert list(parameters) == [
        "module",
        "process_group",
        "auto_wrap_policy",
        "reshard_after_forward",
        "backward_prefetch",
        "forward_prefetch",
        "fsdp_group_size",
        "_is_root",
    ]
    plan = FSDP(net())._plan
    assert plan.reshard_after_forward is True and plan.backward_prefetch == "off" and not plan.forward_prefetch
    assert all(hasattr(hfai, name) for name in hfai.__all__)


def test_hfais_size_based_policy_import_picks_the_blocks():
    import functools

    model = net()
    FSDP(model, auto_wrap_policy=functools.partial(hfai.size_based_auto_wrap_policy, min_num_params=100))
    assert sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)) == ["", "blocks.0", "blocks.1"]


def test_inside_summon_full_params_the_state_dict_is_the_unwrapped_models_and_loads_into_the_shards():
    model = FSDP(net(), auto_wrap_policy={Block})
    with model.summon_full_params():
        state = model.state_dict()
    assert not any(isinstance(v, DTensor) for v in state.values())
    plain = Net()
    plain.load_state_dict(state)  # the unwrapped model takes it as it is
    x = torch.randn(3, 4)
    assert torch.equal(plain(x), model(x))
    other = FSDP(net(seed=1), auto_wrap_policy={Block})
    with other.summon_full_params():
        other.load_state_dict(state)
    assert torch.equal(other(x), plain(x))  # written back to the shards on exit
    assert isinstance(other.module.head.weight, DTensor)


def test_outside_summon_full_params_the_state_dict_is_this_ranks_pieces():
    model = FSDP(net(), auto_wrap_policy={Block})
    local = {k: v.clone() for k, v in model.state_dict().items()}
    assert not any(isinstance(v, DTensor) for v in local.values())
    other = FSDP(net(seed=1), auto_wrap_policy={Block})
    other.load_state_dict(local)
    x = torch.randn(3, 4)
    assert torch.equal(other(x), model(x))


def test_refusals_are_one_line_naming_the_option():
    for kwargs, option in [
        ({"_is_root": False}, "_is_root"),
        ({"backward_prefetch": "pre"}, "backward_prefetch"),
        ({"reshard_after_forward": 0}, "reshard_after_forward"),
        ({"fsdp_group_size": 3}, "fsdp_group_size"),
    ]:
        with pytest.raises(TitanliteError, match=f"^{option}:"):
            FSDP(net(), **kwargs)
    model = FSDP(net())
    with pytest.raises(TitanliteError, match="^load_state_dict: .*misses"):
        with model.summon_full_params():
            model.load_state_dict({})


def test_hfais_policy_module_has_its_counterpart():
    """hfai code imports its policies from `hfai.distributed.fsdp.warp`."""
    from titanlite.compat.hfai import warp

    assert warp.size_based_auto_wrap_policy is hfai.size_based_auto_wrap_policy
    assert warp.transformer_auto_wrap_policy is hfai.transformer_auto_wrap_policy
