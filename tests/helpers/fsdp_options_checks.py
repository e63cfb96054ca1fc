"""The FSDP strategy and option-effect checks, one rank's part: `run_checks` runs as the
"fsdp_options" case of test_parallel_equivalence_4ranks.py's session (session_worker.py),
so it costs no process start of its own.

Every check trains or runs a small model with the wrappers of `titanlite.compat` or the
trainer's own build (`build_model` from a config), and records what the option changed, as
the probes in fsdp_probes.py see it. The single-process references are computed on each
rank from the same seed and the whole global batch, so no second launch is needed; per-rank
figures are gathered, so every rank returns the same record.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.helpers.fsdp_probes import (
    collectives_in,
    fsdp_timeline,
    gathered_during,
    local_bytes,
    ops_in_backward,
    unit_state,
)
from titanlite.compat.fsdp1 import FullyShardedDataParallel as FSDP
from titanlite.compat.hfai import FullyShardedDataParallel as HfaiFSDP
from titanlite.compat.megatron import TorchFullyShardedDataParallel

STEPS, GLOBAL_BATCH = 3, 8


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, depth: int = 4, reverse: bool = False):
        super().__init__()
        self.reverse = reverse  # run the blocks against their registration order
        self.inp, self.blocks, self.out = (
            nn.Linear(6, 16),
            nn.ModuleList(Block(16) for _ in range(depth)),
            nn.Linear(16, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            x = block(x)
        return self.out(x)


def net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows], y[rows]


def train(model: nn.Module, rank: int, world: int, probe: Callable[[], Any] | None = None) -> tuple[list[float], Any]:
    """STEPS steps of AdamW: the global mean losses, and what `probe` saw between the second
    step's forward and backward (FSDP2 sets itself up in the first)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, seen = [], None
    for step in range(1, STEPS + 1):
        x, y = batch(step, rank, world)
        loss = F.mse_loss(model(x), y)
        if step == 2 and probe is not None:
            seen = probe()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
        losses.append(reported.item() / world)
    return losses, seen


def whole_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def per_rank(value):
    """Every rank's `value`, in rank order (on every rank)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# --- the wrappers ----------------------------------------------------------------------------


def strategies(rank: int, world: int, reference: dict) -> dict:
    """Each sharding strategy (and hfai's and the 2D device_mesh's hybrid form): losses and
    trained weights against one process, this rank's share of the parameter bytes, and the
    blocks' parameters between forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh

    layouts = {
        "FULL_SHARD": lambda m: FSDP(m, auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD"),
        "SHARD_GRAD_OP": lambda m: FSDP(m, auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP"),
        "HYBRID_SHARD": lambda m: FSDP(
            m, auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD", fsdp_group_size=2
        ),
        "_HYBRID_SHARD_ZERO2": lambda m: FSDP(
            m, auto_wrap_policy={Block}, sharding_strategy="_HYBRID_SHARD_ZERO2", fsdp_group_size=2
        ),
        "NO_SHARD": lambda m: FSDP(m, auto_wrap_policy={Block}, sharding_strategy="NO_SHARD"),
        "HYBRID_SHARD_device_mesh": lambda m: FSDP(
            m,
            auto_wrap_policy={Block},
            sharding_strategy="HYBRID_SHARD",
            device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
        ),
        "hfai_fsdp_group_size_2": lambda m: HfaiFSDP(m, auto_wrap_policy={Block}, fsdp_group_size=2),
    }
    results = {}
    for name, wrap in layouts.items():
        model = wrap(net())
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        share = local_bytes(model.parameters()) / full_bytes
        losses, after_forward = train(model, rank, world, probe=lambda: unit_state(model.module.blocks[0]))
        results[name] = {
            "losses": losses,
            "weights_vs_reference": max_difference(whole_weights(model.module), reference["weights"]),
            "byte_share": per_rank(share),
            "after_forward": after_forward,
        }
    return results


def reshard_after_forward(rank: int, world: int) -> dict:
    """The blocks between forward and backward, for the settings the strategies above do not
    cover (FSDP1's True and False are FULL_SHARD's and SHARD_GRAD_OP's, hfai's default True
    its hybrid layout's)."""
    cases = {
        "fsdp1_2": lambda m: FSDP(m, auto_wrap_policy={Block}, reshard_after_forward=2),
        "hfai_false": lambda m: HfaiFSDP(m, auto_wrap_policy={Block}, reshard_after_forward=False),
        "megatron_default": lambda m: megatron(m, SimpleNamespace()),
        "megatron_false": lambda m: megatron(m, SimpleNamespace(reshard_after_forward=False)),
        "megatron_2": lambda m: megatron(m, SimpleNamespace(reshard_after_forward=2)),
    }
    results = {}
    for name, wrap in cases.items():
        model = wrap(net())
        results[name] = train(model, rank, world, probe=lambda: unit_state(model.module.blocks[0]))[1]
    return results


def megatron(model: nn.Module, ddp_config, recompute: str | None = None) -> TorchFullyShardedDataParallel:
    config = SimpleNamespace(transformer_impl="local", recompute_granularity=recompute)
    return TorchFullyShardedDataParallel(config, ddp_config, model, sub_modules_to_wrap={Block})


def prefetch(rank: int, world: int) -> dict:
    """Whose all-gathers run in each unit's turn of forward and backward (one step after a warm-up)."""
    cases = {
        "fsdp1_default": lambda: FSDP(net(), auto_wrap_policy={Block}),
        "fsdp1_backward_none": lambda: FSDP(net(), auto_wrap_policy={Block}, backward_prefetch=None),
        "fsdp1_forward_prefetch": lambda: FSDP(net(), auto_wrap_policy={Block}, forward_prefetch=True),
        "hfai_default": lambda: HfaiFSDP(net(), auto_wrap_policy={Block}),
        # Megatron prefetches by module order under recompute; a model run in reverse shows it.
        "megatron_reverse": lambda: megatron(net(reverse=True), SimpleNamespace()),
        "megatron_reverse_recompute": lambda: megatron(net(reverse=True), SimpleNamespace(), recompute="full"),
    }
    results = {}
    for name, build in cases.items():
        model = build()
        x = batch(1, rank, world)[0]
        model(x).sum().backward()
        timeline = fsdp_timeline(lambda: model(x).sum().backward())
        results[name] = {
            "forward": gathered_during(timeline, "pre_forward"),
            "backward": gathered_during(timeline, "pre_backward"),
        }
    return results


def sync_module_states(rank: int, world: int, reference: dict) -> dict:
    """Ranks start from different seeds; with sync_module_states the model is rank 0's."""
    results = {}
    for sync in (True, False):
        model = FSDP(net(seed=rank), auto_wrap_policy={Block}, sync_module_states=sync)
        results[f"sync_{sync}"] = {
            "start_vs_rank0_seed": max_difference(whole_weights(model.module), reference["initial"])
        }
    model = FSDP(net(seed=rank), auto_wrap_policy={Block}, sync_module_states=True)
    results["sync_True"]["losses"] = train(model, rank, world)[0]
    return results


def no_sync(rank: int, world: int) -> dict:
    """Two microbatches, the first inside no_sync: what it reduces, and the gradients after."""
    model = FSDP(net(), auto_wrap_policy={Block})
    (x1, y1), (x2, y2) = batch(1, rank, world), batch(2, rank, world)
    with model.no_sync():
        inside = collectives_in(lambda: F.mse_loss(model(x1), y1).backward())
    grads_inside = [p.grad is not None for p in model.parameters()]
    outside = collectives_in(lambda: F.mse_loss(model(x2), y2).backward())
    reference = net()
    for r in range(world):
        for step in (1, 2):
            x, y = batch(step, r, world)
            (F.mse_loss(reference(x), y) / world).backward()
    difference = max(
        (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
    )
    return {
        "reductions_inside": sum(v for k, v in inside.items() if "reduce" in k),
        "reductions_after": sum(v for k, v in outside.items() if "reduce" in k),
        "sharded_grads_set_inside": any(grads_inside),
        "grads_vs_reference": difference,
    }


def summon_writeback(rank: int, world: int) -> dict:
    """Whole parameters edited under summon_full_params(writeback=True) reach every rank's shard."""
    results = {}
    for writeback in (True, False):
        model = FSDP(net(), auto_wrap_policy={Block})
        with FSDP.summon_full_params(model, writeback=writeback):
            weight = model.module.blocks[1].up.weight
            whole = weight.shape
            weight.data.copy_(torch.arange(weight.numel(), dtype=weight.dtype).view(whole))
        after = model.module.blocks[1].up.weight.full_tensor()
        results[f"writeback_{writeback}"] = bool(
            torch.equal(after, torch.arange(after.numel(), dtype=after.dtype).view(whole))
        )
    return results


# --- the trainer's own options (its build, from a config) -----------------------------------


def trainer_model(overrides: list[str]):
    from tests.helpers.distributed import EQUIVALENCE_ARGS
    from titanlite.build import build_model, plan_run
    from titanlite.config import load_config

    plan = plan_run(load_config([*EQUIVALENCE_ARGS, *overrides]), dist.get_world_size())
    built = build_model(plan, torch.device("cpu"), plan.dims.build_mesh("cpu"), dist.get_world_size())
    tokens = torch.randint(0, plan.model_args.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    return built.model, tokens


# One build per row, the options folded so that each setting is checked once: (reshard,
# prefetch depth, activation checkpointing). Prefetch is read without AC (a recompute runs
# FSDP's forward hooks again inside backward); with reshard "never" only forward gathers.
TRAINER_BUILDS = [
    ("default", "0", ["none"]),
    ("always", "2", ["none"]),
    ("never", "1", ["full"]),
    ("2", "0", ["selective", "op"]),
    ("default", "0", ["selective", "2"]),
]
FORWARD_OPS = {"silu", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math"}


def trainer_options() -> dict:
    """The trainer's reshard, prefetch and AC settings, each through `build_model`."""
    results: dict[str, dict] = {"reshard": {}, "prefetch": {}, "ac": {}}
    for reshard, depth, ac in TRAINER_BUILDS:
        model, tokens = trainer_model(
            [
                "--parallelism.fsdp_reshard_after_forward",
                reshard,
                "--parallelism.fsdp_prefetch_depth",
                depth,
                "--activation_checkpoint.mode",
                ac[0],
                *(["--activation_checkpoint.selective_ac_option", ac[1]] if len(ac) > 1 else []),
            ]
        )
        model(tokens).sum().backward()  # the first call sets FSDP2 up
        loss = model(tokens).sum()
        results["reshard"].setdefault(
            reshard, {name: unit_state(model.get_submodule(name)) for name in ("layers.0", "layers.5")}
        )
        counts = ops_in_backward(loss, FORWARD_OPS)
        results["ac"]["_".join(ac)] = {
            "silu": counts["silu"],
            "attention": sum(v for k, v in counts.items() if "scaled_dot_product" in k),
        }
        if depth != "0":  # 0 is FSDP2's implicit order, which the wrappers' default shows
            timeline = fsdp_timeline(lambda: model(tokens).sum().backward())
            results["prefetch"].setdefault(
                depth,
                {
                    "forward": gathered_during(timeline, "pre_forward"),
                    "backward": gathered_during(timeline, "pre_backward"),
                    "reshard": reshard,
                },
            )
    return results


def run_checks() -> dict:
    """Every check, in order (each rank runs them all; collectives keep them in step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = net()
    reference = {"initial": whole_weights(plain), "losses": train(plain, 0, 1)[0]}
    reference["weights"] = whole_weights(plain)
    return {
        "reference_losses": reference["losses"],
        "strategies": strategies(rank, world, reference),
        "reshard_after_forward": reshard_after_forward(rank, world),
        "prefetch": prefetch(rank, world),
        "sync_module_states": sync_module_states(rank, world, reference),
        "no_sync": no_sync(rank, world),
        "summon_writeback": summon_writeback(rank, world),
        "trainer": trainer_options(),
    }
