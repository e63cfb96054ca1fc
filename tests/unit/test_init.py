"""Shard-sized initialization (models/init.py): every layout holds the values one process
holds, each rank computes only its shard, and the distributions are the configured ones.

Layouts are checked on ranks of a fake process group (collectives are no-ops; DTensor
still computes each rank's shard), against DTensor's own slicing of the single-process
weights. One process per rank: DTensor caches layouts by mesh, so a process that became
several ranks in turn would keep its first rank's meshes.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite.build import build_on_meta, plan_run
from titanlite.config import load_config
from titanlite.models import init as init_module
from titanlite.models.init import ShardInit, normal_from_uniform, parameter_keys, signed_uniform, unwrapped_name

SEED = 7
# Sizes that split unevenly: vocab 1000 over 8 FSDP ranks of 2 TP shards (500 -> 63 x 7 + 59).
VOCAB = 1000

# name: (world size, model, overrides).
LAYOUTS = {
    "fsdp8": (8, "llama3", []),
    "tp2": (2, "llama3", ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp8_tp2": (16, "llama3", ["--parallelism.tensor_parallel_degree", "2"]),
    "hsdp2x2_tp2_ac": (
        8,
        "llama3",
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
    "gpt2_fsdp4_tp2": (8, "gpt2", ["--parallelism.tensor_parallel_degree", "2"]),
    # QK norms replicated over tp, the router and the stacked experts whole on each tp rank
    # and FSDP-sharded by expert.
    "qwen3_moe_fsdp4_tp2": (8, "qwen3/debugmodel_moe", ["--parallelism.tensor_parallel_degree", "2"]),
}


def plan_for(model: str, overrides: list[str], world: int):
    """`model`: a model name, or name/flavor."""
    name, _, flavor = model.partition("/")
    cfg = load_config(
        [
            "--config",
            "debug_model",
            "--model.name",
            name,
            *(["--model.flavor", flavor] if flavor else []),
            "--training.seed",
            str(SEED),
            "--training.mixed_precision_param",
            "float32",
            "--training.local_batch_size",
            "16",
            *overrides,
        ]
    )
    return plan_run(cfg, world, vocab_size=VOCAB)


def init_rank(plan, world: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s parallelized, initialized model on a fake process group: name -> param."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    model = build_on_meta(plan, plan.dims.build_mesh("cpu"))
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    return {unwrapped_name(name): param for name, param in model.named_parameters()}


def single_process_weights(plan) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = plan.spec.model_class(plan.model_args)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    return {name: param.detach() for name, param in model.named_parameters()}


def check_rank(rank: int) -> list[str]:
    """Every layout this rank belongs to: the parameters whose shard differs from the slice."""
    failures = []
    for layout, (world, model, overrides) in LAYOUTS.items():
        if rank >= world:
            continue
        reference = single_process_weights(plan_for(model, [], 1))
        params = init_rank(plan_for(model, overrides, world), world, rank)
        assert params.keys() == reference.keys()
        for name, param in params.items():
            expected = distribute_tensor(reference[name], param.device_mesh, param.placements, src_data_rank=None)
            if not (isinstance(param, DTensor) and torch.equal(param.to_local(), expected.to_local())):
                failures.append(f"{layout} rank {rank}: {name}")
        dist.destroy_process_group()
    return failures


def test_shards_are_generated_in_bounded_chunks(monkeypatch):
    """A chunk never holds more than CHUNK_ELEMENTS values (or one row), and chunking does
    not change the values."""
    linear = torch.nn.Linear(40, 30, bias=False)
    full = ShardInit(linear, SEED)
    full.normal(linear.weight, std=1.0)
    expected = linear.weight.detach().clone()
    sizes = []
    original = init_module.signed_uniform
    monkeypatch.setattr(init_module, "CHUNK_ELEMENTS", 100)
    monkeypatch.setattr(
        init_module, "signed_uniform", lambda flat, *a: (sizes.append(flat.numel()), original(flat, *a))[1]
    )
    ShardInit(linear, SEED).normal(linear.weight, std=1.0)
    assert max(sizes) == 80 and sum(sizes) == 1200  # 2 rows of 40 per chunk
    assert torch.equal(linear.weight, expected)


def test_values_depend_on_seed_and_name_not_on_wrappers():
    a, b = (signed_uniform(torch.arange(1000), parameter_keys(SEED, name), False) for name in ("w1", "w2"))
    assert not torch.equal(a, b)
    assert torch.equal(a, signed_uniform(torch.arange(1000), parameter_keys(SEED, "w1"), False))
    assert not torch.equal(a, signed_uniform(torch.arange(1000), parameter_keys(SEED + 1, "w1"), False))
    assert (
        unwrapped_name("layers.3._checkpoint_wrapped_module._orig_mod.attention.wq.weight")
        == "layers.3.attention.wq.weight"
    )


def test_wide_parameters_mix_in_the_high_half_of_the_index():
    """Below 2^32 elements the high half is 0 and skipped: the same values either way."""
    index = torch.arange(5000) * 7919
    keys = parameter_keys(SEED, "big")
    assert torch.equal(signed_uniform(index.clone(), keys, False), signed_uniform(index.clone(), keys, True))
    high = index + (3 << 32)
    assert not torch.equal(signed_uniform(high.clone(), keys, True), signed_uniform(index.clone(), keys, True))


def test_uniforms_are_uniform_and_uncorrelated():
    n = 1 << 20
    u = signed_uniform(torch.arange(n), parameter_keys(SEED, "u"), False)
    assert -1 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=32, min=-1, max=1)
    chi2 = float(((counts - n / 32) ** 2 / (n / 32)).sum())
    assert chi2 < 70  # 31 degrees of freedom: p < 1e-4 beyond this
    neighbours = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    other = signed_uniform(torch.arange(n), parameter_keys(SEED, "v"), False)
    assert abs(float(neighbours)) < 5e-3 and abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 5e-3


@pytest.mark.parametrize("std, bounds", [(0.02, (-2.0, 2.0)), (0.0625, (-3 * 0.0625, 3 * 0.0625)), (1.0, None)])
def test_normal_and_truncated_normal_match_torch(std, bounds):
    """Same mean, spread and bounds as torch.nn.init's samplers (which use the same inverse CDF)."""
    n = 1 << 20
    s = signed_uniform(torch.arange(n), parameter_keys(SEED, "w"), False)
    reference = torch.empty(n)
    if bounds is None:
        ours = normal_from_uniform(s, std, -1.0, 1.0)
        torch.nn.init.normal_(reference, 0.0, std, generator=torch.Generator().manual_seed(0))
    else:
        a, b = bounds
        low, high = (math.erf(x / (std * math.sqrt(2.0))) for x in bounds)
        ours = normal_from_uniform(s, std, low, high).clamp_(a, b)
        torch.nn.init.trunc_normal_(reference, 0.0, std, a, b, generator=torch.Generator().manual_seed(0))
        assert a <= ours.min() and ours.max() <= b
    assert float(ours.mean()) == pytest.approx(0.0, abs=5 * std / math.sqrt(n))
    assert float(ours.std()) == pytest.approx(float(reference.std()), rel=5e-3)
    for k in (1, 2):
        assert float((ours.abs() < k * std).float().mean()) == pytest.approx(
            float((reference.abs() < k * std).float().mean()), abs=3e-3
        )


def test_llama_init_keeps_its_distributions():
    plan = plan_for("llama3", [], 1)
    weights = single_process_weights(plan)
    args = plan.model_args
    assert torch.all(weights["norm.weight"] == 1) and torch.all(weights["layers.0.ffn_norm.weight"] == 1)
    assert float(weights["tok_embeddings.weight"].std()) == pytest.approx(1.0, rel=0.02)
    assert float(weights["layers.0.attention.wq.weight"].std()) == pytest.approx(0.02, rel=0.02)
    depth_std = 0.02 / math.sqrt(2 * 6)  # last block of 6: depth-scaled
    assert float(weights["layers.5.feed_forward.w2.weight"].std()) == pytest.approx(depth_std, rel=0.02)
    cutoff = 3 * args.dim**-0.5
    assert float(weights["output.weight"].abs().max()) <= cutoff
    assert float(weights["output.weight"].std()) == pytest.approx(
        args.dim**-0.5 * 0.9866, rel=0.02
    )  # 3-sigma truncation


def test_gpt2_init_keeps_its_distributions():
    plan = plan_for("gpt2", [], 1)
    weights = single_process_weights(plan)
    assert torch.all(weights["ln_f.weight"] == 1) and torch.all(weights["ln_f.bias"] == 0)
    assert torch.all(weights["layers.0.attn.c_attn.bias"] == 0)
    assert float(weights["embeddings.wte.weight"].std()) == pytest.approx(0.02, rel=0.02)
    residual_std = 0.02 / math.sqrt(2 * plan.model_args.n_layers)
    assert float(weights["layers.1.mlp.c_proj.weight"].std()) == pytest.approx(residual_std, rel=0.02)


def test_a_parameter_filled_alone_gets_its_values():
    """Values do not depend on the order parameters are filled in, or on the others."""
    plan = plan_for("llama3", [], 1)
    first = single_process_weights(plan)
    with torch.device("meta"):
        model = plan.spec.model_class(plan.model_args)
    model.to_empty(device="cpu")
    init = ShardInit(model, SEED)
    init.normal(model.tok_embeddings.weight, std=1.0)  # filled alone, out of the model's order
    assert torch.equal(model.tok_embeddings.weight, first["tok_embeddings.weight"])


if __name__ == "__main__":
    failed = check_rank(int(sys.argv[1]))
    print("\n".join(failed))
    sys.exit(1 if failed else 0)
