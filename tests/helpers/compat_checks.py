"""The compat wrappers on several ranks, each function a `call` case of one session per world
size (tests/runs/test_compat_ranks.py): every rank runs it in the session's gloo group and
returns the same record. References are computed on each rank from the same seed with no
wrapper, on the whole global batch, so no second launch is needed.

- `megatron_gpt` (2 ranks): megatron-core's real `GPTModel` (local layer spec) wrapped by
  `titanlite.compat.megatron` under both `transformer_impl` values, trained by megatron-core's
  own no-pipelining schedule (which calls its `finalize_model_grads`), against the unwrapped model;
- `fsdp1_nested_prefetch` (2 ranks): `backward_prefetch=None` and `forward_prefetch` under a
  nested wrap policy, as the profiler sees FSDP2's all-gathers;
- `fsdp1_clip_with_ignored_modules` (4 ranks): `clip_grad_norm_` with an ignored module, against
  FSDP1's norm (the sharded gradients over all ranks, plus this rank's own unsharded ones).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

STEPS, MICROBATCHES, ROWS, SEQ, VOCAB = 3, 2, 4, 8, 64


# --- Megatron-core's GPTModel ---------------------------------------------------------------


def megatron_on_cpu() -> None:
    """Megatron's parallel state on the session's ranks (tp = pp = 1, dp = world), and CPU
    stand-ins for the two CUDA-only pieces its local attention touches: the scratch buffer
    `DotProductAttention` multiplies into, and the CUDA RNG fork around its dropout (0 here)."""
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float32)] = torch.empty(1 << 16)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def gpt(transformer_impl: str | None, seed: int = 0) -> nn.Module:
    """A 2-layer megatron-core GPTModel of the local layer spec; `transformer_impl` None keeps
    TransformerConfig's default."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    impl = {} if transformer_impl is None else {"transformer_impl": transformer_impl}
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        **impl,
    )
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
    )


def gpt_batches(step: int, rows: slice) -> list[torch.Tensor]:
    """The microbatches of `step`'s global batch, `rows` of each."""
    tokens = torch.randint(0, VOCAB, (MICROBATCHES, ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return [mb[rows] for mb in tokens]


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Megatron's forward with labels: per-token losses, averaged over this microbatch."""
    return gpt_token_losses(model, tokens).mean() / MICROBATCHES


def gpt_token_losses(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    rows = tokens.shape[0]
    positions = torch.arange(SEQ).expand(rows, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    return model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:])


class CudaCounterOnCpu(TorchFunctionMode):
    """megatron-core's no-pipelining schedule counts tokens in a tensor it makes with
    `device="cuda"` (schedules.py, `total_num_tokens`), the one CUDA-only line on its path:
    that tensor is made on the CPU instead. Everything else runs as megatron-core wrote it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(kwargs.get("device")) == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def megatron_forward_step(data_iterator, model: nn.Module):
    """A Megatron `forward_step_func`: the next microbatch's per-token losses and the loss
    function the schedule reduces them with (the mean; the schedule divides by the microbatches)."""
    output = gpt_token_losses(model, next(data_iterator))

    def loss_func(losses: torch.Tensor):
        loss = losses.mean()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return output, loss_func


def train_megatron_order(wrapped: nn.Module, rank: int, world: int) -> tuple[list[float], list[dict]]:
    """Megatron's train step: `zero_grad_buffer`, then megatron-core's own schedule
    (`get_forward_backward_func()`: `forward_backward_no_pipelining` at pp 1) runs every
    microbatch but the last under the config's `no_sync_func` and calls its
    `finalize_model_grads_func` (megatron-core's `finalize_model_grads`) with the arguments it
    passes (`pg_collection`, `force_all_reduce`), then the optimizer step. Returns the losses
    and, for each finalize call, the keywords it got and whether its data-parallel group is
    the wrapper's."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    calls = []

    def finalize(model: list[nn.Module], num_tokens: torch.Tensor | None = None, **keywords) -> None:
        group = keywords["pg_collection"].dp_cp
        calls.append({"keywords": sorted(keywords), "wrapper_group": group is wrapped.process_group})
        finalize_model_grads(model, num_tokens, **keywords)

    wrapped.config.no_sync_func = wrapped.no_sync
    wrapped.config.finalize_model_grads_func = finalize
    forward_backward = get_forward_backward_func()
    assert forward_backward.__name__ == "forward_backward_no_pipelining", forward_backward
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    losses = []
    for step in range(1, STEPS + 1):
        wrapped.zero_grad_buffer()
        batches = gpt_batches(step, slice(rank * ROWS // world, (rank + 1) * ROWS // world))
        with CudaCounterOnCpu():
            reduced = forward_backward(
                forward_step_func=megatron_forward_step,
                data_iterator=iter(batches),
                model=wrapped,
                num_microbatches=MICROBATCHES,
                seq_length=SEQ,
                micro_batch_size=len(batches[0]),
            )
        optimizer.step()
        total = sum(r["lm loss"] for r in reduced) / MICROBATCHES
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, calls


def train_unwrapped(model: nn.Module) -> list[float]:
    """The same steps on one process over the whole global batch, no wrapper."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for tokens in gpt_batches(step, slice(0, ROWS)):
            loss = gpt_loss(model, tokens)
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses


def megatron_gpt() -> dict:
    """For each transformer_impl (the local one, and TransformerConfig's default): the units,
    the losses of both runs, and the largest difference of the trained weights."""
    from titanlite.compat.megatron import TorchFullyShardedDataParallel

    megatron_on_cpu()
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
        TorchFullyShardedDataParallelConfig,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for impl in ("local", None):
        reference = gpt(impl)
        reference_losses = train_unwrapped(reference)
        model = gpt(impl)
        wrapped = TorchFullyShardedDataParallel(model.config, TorchFullyShardedDataParallelConfig(), model)
        units = [name for name, m in model.named_modules() if name and isinstance(m, FSDPModule)]
        losses, finalized = train_megatron_order(wrapped, rank, world)
        expected = dict(reference.named_parameters())
        difference = max(
            ((p.full_tensor() if isinstance(p, DTensor) else p) - expected[name]).abs().max().item()
            for name, p in model.named_parameters()
        )
        results[model.config.transformer_impl] = {
            "units": units,
            "losses": losses,
            "finalized": finalized,
            "reference_losses": reference_losses,
            "weights_vs_reference": difference,
            "weights_compared": len(expected),
        }
    return results


# --- FSDP1's prefetch options under a nested wrap policy ------------------------------------


def fsdp1_nested_prefetch() -> dict:
    """Whose all-gathers run in each unit's turn (one step after a warm-up), with the blocks
    and, inside each, its mlp as units: `backward_prefetch=None` and `forward_prefetch=True`
    must reach the inner units too."""
    from tests.helpers.fsdp_probes import fsdp_timeline, gathered_during
    from tests.helpers.small_nets import net
    from titanlite.compat.fsdp1 import FullyShardedDataParallel as FSDP

    results = {}
    for name, options in (("backward_none", {"backward_prefetch": None}), ("forward", {"forward_prefetch": True})):
        model = net()
        chosen = {*model.blocks, *(block.mlp for block in model.blocks)}
        wrapped = FSDP(model, auto_wrap_policy=lambda m: m in chosen, **options)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        wrapped(x).sum().backward()
        timeline = fsdp_timeline(lambda: wrapped(x).sum().backward())
        results[name] = {
            "forward": gathered_during(timeline, "pre_forward"),
            "backward": gathered_during(timeline, "pre_backward"),
        }
    return results


# --- FSDP1's clip_grad_norm_ with ignored modules --------------------------------------------


def local(grad: torch.Tensor, full: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part of `full` (default: of `grad`) as `grad` is laid out (FSDP2's Shard(0) chunks)."""
    if not isinstance(grad, DTensor):
        return grad if full is None else full
    if full is None:
        return grad.to_local()
    (placement,) = grad.placements
    return full.chunk(grad.device_mesh.size(), dim=placement.dim)[grad.device_mesh.get_local_rank()]


def plain_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model(x).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def fsdp1_clip_with_ignored_modules() -> dict:
    """Each rank's norm from `clip_grad_norm_` (the ignored head keeps its local, unreduced
    gradient, as in FSDP1), FSDP1's norm for that rank computed with no wrapper, and this
    rank's clipped gradients against the reference's scaled by FSDP1's coefficient. The norms
    differ from rank to rank (so do FSDP1's: it adds each rank's own unsharded gradients)."""
    from tests.helpers.small_nets import Block, net
    from titanlite.compat.fsdp1 import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = net()
    wrapped = FSDP(model, auto_wrap_policy={Block}, ignored_modules=[model.head])
    inputs = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(7))
    rows = slice(2 * rank, 2 * rank + 2)
    wrapped(inputs[rows]).square().mean().backward()
    norm = wrapped.clip_grad_norm_(0.5).item()

    per_rank = [plain_grads(net(), inputs[2 * r : 2 * r + 2]) for r in range(world)]
    grads = {  # FSDP's: the mean over the ranks; the ignored head's: this rank's own, unreduced
        name: per_rank[rank][name] if name.startswith("head.") else sum(g[name] for g in per_rank) / world
        for name in per_rank[0]
    }
    expected = sum(g.square().sum() for g in grads.values()).sqrt().item()
    coefficient = min(1.0, 0.5 / (expected + 1e-6))
    clipped = max(  # each rank scales its own shards by its own norm's coefficient, as FSDP1 does
        (local(p.grad) - local(p.grad, grads[name] * coefficient)).abs().max().item()
        for name, p in wrapped.named_parameters()
    )
    values = [None] * world
    dist.all_gather_object(values, {"norm": norm, "fsdp1_norm": expected, "clipped_vs_reference": clipped})
    return {"ranks": values}
