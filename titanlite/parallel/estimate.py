"""Per-rank memory of a training step: exact state bytes from a parallelized model's local
shards, plus estimates of activations and FSDP's gathered working set.

The state (parameters, gradients, AdamW's two moments, buffers) is read from the DTensor
local shapes of the model `build.parallelize` produced, so it is exact for any layout. The
rest is a formula (docs/planning.md explains each term), counting what autograd keeps for
backward in the shared decoder's block as titanlite writes it. Notation: b =
training.local_batch_size, s = seq_len, t = tensor-parallel degree, d = dim, q, k, v, o, l = the
args' `attention_widths` (model_spec.AttentionWidths; GQA: q = o = n_heads x head_dim, d for
Llama, k = v = n_kv_heads x head_dim, l = 0), f = ffn hidden size, V = vocab, p = bytes of the
compute dtype (mixed_precision_param), 4 = float32.

    tokens          N = b s / c (c = context-parallel degree);  r = t under sequence parallelism, else 1
    one block       A = N (2 d/r p + 2 d p + (q + k)/t 4 + (q + o + (k + v) c)/t p + l p + 4 f/t p)
                    (+ (q + k)/t p for the inputs of QK norms; a mixture-of-experts block's
                    feed-forward term is `feed_forward_per_token`'s)
    checkpointed    N d/r p  (only its input)
    head            N d/r p + N d p + N V' 4, V' = V/t with loss parallel, else V
    peak            blocks kept + head + max(N V' p, A if any block is checkpointed)

The peak is the loss (every block's activations, the logits and the loss's float32
exponentials at once), or, with activation checkpointing, the recompute of one block. Under
context parallelism a rank keeps its own tokens' activations and, for the attention's
backward, every rank's keys and values (the all-gathered k and v: (k + v) c per local token);
the mask is flex_attention's block mask on the GPUs planned for, small enough to leave out.

Under pipeline parallelism N is one pipeline microbatch's tokens, the blocks are this rank's
stages' blocks, the head is counted on the rank of the last stage only, and blocks and head
are held for `in_flight` microbatches at once: those a schedule has run forward but not yet
backward at its peak on this rank (`in_flight_microbatches`). On top, torch's stages allocate
their receive buffers up front, one per microbatch and direction: `boundary_buffers` of
N d/r p each (activations in, unless the first stage; output gradients in, unless the last).

Under expert parallelism (ep > 1) a rank computes the routed copies its experts receive
instead of its own: N K of them on average, as many as it sends (balanced routing), so the
kept terms do not change. On top, one MoE layer's all-to-all buffers at a time: the rows
received and the outputs sent back, 2 N K d p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.config.dtypes import torch_dtype
from titanlite.parallel.placement import local_tensor

if TYPE_CHECKING:  # parallel/ imports no model code: the args' type only
    from titanlite.model_spec import DecoderArgs


@dataclass(frozen=True)
class StateBytes:
    """This rank's exact share of the training state, from the local shards."""

    n_params: int  # local elements of all parameters
    n_trained: int  # those the optimizer updates (fewer where some are frozen: LoRA)
    params: int
    grads: int
    optimizer: int  # AdamW exp_avg and exp_avg_sq, like the parameters
    buffers: int


def state_bytes(model: nn.Module) -> StateBytes:
    """Bytes this rank holds for weights, gradients, optimizer state and buffers."""
    params = [local_tensor(p) for p in model.parameters()]
    trained = [local_tensor(p) for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trained)
    buffer_bytes = sum(local_tensor(b).numel() * b.element_size() for b in model.buffers())
    n_params, n_trained = sum(p.numel() for p in params), sum(p.numel() for p in trained)
    return StateBytes(n_params, n_trained, param_bytes, grad_bytes, 2 * grad_bytes, buffer_bytes)


@dataclass(frozen=True)
class StepShape:
    """What the activation formula needs from the config and the model's hyperparameters."""

    batch: int
    seq_len: int
    tp: int
    loss_parallel: bool
    sequence_parallel: bool
    act_bytes: int  # p: 2 for bfloat16, 4 for float32
    ac_mode: str
    ac_option: str  # selective: "k" (every k-th block) or "op"
    cp: int = 1
    ep: int = 1
    etp: int = 1  # routed experts split over tp: each rank keeps 1/etp of their hidden tensors

    @classmethod
    def from_config(cls, cfg: Any, tp: int) -> StepShape:
        return cls(
            cfg.training.local_batch_size,
            cfg.training.seq_len,
            tp,
            cfg.parallelism.enable_loss_parallel and tp > 1,
            tp > 1 and cfg.parallelism.sequence_parallel != "off",  # "auto" is on, on the GPUs planned for
            torch_dtype(cfg.training.mixed_precision_param).itemsize,
            cfg.activation_checkpoint.mode,
            cfg.activation_checkpoint.selective_ac_option,
            cfg.parallelism.context_parallel_degree,
            cfg.parallelism.expert_parallel_degree,
            cfg.parallelism.expert_tensor_parallel_degree,
        )


@dataclass(frozen=True)
class Activations:
    """The activation estimate's terms, in bytes (see the module docstring)."""

    block: float  # one block's saved activations, A
    checkpointed_block: float  # what a checkpointed block keeps
    n_checkpointed: int
    n_blocks: int
    head: float  # final norm and output projection inputs, and the logits
    peak_extra: float  # on top at the peak: loss gradients or one block's recompute
    in_flight: int = 1  # microbatches held at once (pipeline schedules)
    buffers: float = 0.0  # a pipeline stage's receive buffers
    all_to_all: float = 0.0  # expert parallelism's exchange buffers of one MoE layer

    @property
    def kept(self) -> float:
        one = (self.n_blocks - self.n_checkpointed) * self.block + self.n_checkpointed * self.checkpointed_block
        return self.in_flight * (one + self.head)

    @property
    def total(self) -> float:
        return self.kept + self.peak_extra + self.buffers + self.all_to_all


def checkpointed_blocks(n_layers: int, mode: str, option: str) -> int:
    """How many blocks `apply_ac` wraps whole: all, every k-th, or none (per-op AC keeps part
    of every block instead, see `estimate_activations`)."""
    if mode == "selective" and option != "op":
        return n_layers // int(option)
    return n_layers if mode == "full" else 0


def estimate_activations(
    args: DecoderArgs,
    shape: StepShape,
    n_blocks: int | None = None,
    holds_head: bool = True,
    in_flight: int = 1,
    boundary_buffers: int = 0,
) -> Activations:
    """The formula of the module docstring for one microbatch on one rank: `n_blocks` of the
    model's blocks (all by default), the head where `holds_head`, `in_flight` microbatches,
    `boundary_buffers` pipeline receive buffers."""
    n, t, p, d = shape.batch * shape.seq_len / shape.cp, shape.tp, shape.act_bytes, args.dim
    r = t if shape.sequence_parallel else 1
    attention, feed_forward = attention_per_token(args, shape), feed_forward_per_token(args, t, p, shape.etp)
    block = n * (2 * d / r * p + 2 * d * p + attention + feed_forward)
    vocab = args.vocab_size / t if shape.loss_parallel else args.vocab_size
    n_blocks = args.n_layers + args.mtp_depths if n_blocks is None else n_blocks
    n_ckpt = checkpointed_blocks(n_blocks, shape.ac_mode, shape.ac_option)
    recompute = block if n_ckpt else 0.0
    if shape.ac_mode == "selective" and shape.ac_option == "op":
        # Per-op: the block's input, every other matmul output (q, v, the first feed-forward
        # projection, the last one's partial sums) and attention's output; the rest recomputed.
        kept = n * (d / r * p + (2 * d + args.attention_widths.v + args.ffn_hidden_dim) / t * p + d * p)
        block, recompute = kept, block - kept
    head = n * d / r * p + n * d * p + n * vocab * 4 if holds_head else 0.0
    extra = max(n * vocab * p if holds_head else 0.0, recompute)
    buffers = boundary_buffers * n * d / r * p
    # Expert parallelism's buffers for one MoE layer of `n` tokens: the routed copies received
    # (n top_k rows of dim, balanced) and the outputs sent back; 0 without MoE.
    moe = shape.ep > 1 and args.moe is not None and args.n_moe_layers
    all_to_all = 2 * n * args.moe.top_k * args.dim * p if moe else 0.0
    return Activations(block, n * d / r * p, n_ckpt, n_blocks, head, extra, in_flight, buffers, all_to_all)


def attention_per_token(args: DecoderArgs, shape: StepShape) -> float:
    """Bytes a block's attention keeps per token: (q + k)/t 4 + (q + o + (k + v) c)/t p + l p,
    and (q + k)/t p for the inputs of QK norms (`attention_widths`: q is d unless the model
    sets head_dim apart from dim)."""
    widths, t, p = args.attention_widths, shape.tp, shape.act_bytes
    q, k, v = widths.q, widths.k, widths.v
    norm_inputs = (q + k) / t * p if args.qk_norm else 0
    return (q + k) / t * 4 + (q + widths.out + (k + v) * shape.cp) / t * p + norm_inputs + widths.latent * p


def feed_forward_per_token(args: DecoderArgs, t: int, p: int, etp: int = 1) -> float:
    """Bytes a block's feed-forward keeps per token, averaged over the blocks: SwiGLU's four
    hidden-size tensors (4 f/t p), or in a mixture-of-experts block (`args.moe`, in
    `args.n_moe_layers` of the blocks, not split by tp) the router's float32 logits and
    scores (2 E 4) and, for each of the top_k copies of the token, its gathered input, the
    expert's four hidden tensors, its output and that output in float32 for the weighting
    (K (2 d p + 4 h p + 4 d)), the hidden ones split over tp under expert tensor parallelism
    (`etp`: 4 h p / etp)."""
    dense = 4 * args.ffn_hidden_dim / t * p
    moe, n_moe = args.moe, args.n_moe_layers
    if moe is None or not n_moe:
        return dense
    sparse = 2 * moe.n_experts * 4 + moe.top_k * (2 * args.dim * p + 4 * moe.hidden_dim / etp * p + 4 * args.dim)
    n_blocks = args.n_layers + args.mtp_depths  # multi-token prediction blocks are blocks too
    return (n_moe * sparse + (n_blocks - n_moe) * dense) / n_blocks


def in_flight_microbatches(schedule: str, degree: int, n_microbatches: int, stages_per_rank: int, pp_rank: int) -> int:
    """Microbatches each of this rank's stages holds activations of at the schedule's peak
    (run forward, backward not yet): GPipe and LoopedBFS run every forward first (all of
    them); 1F1B starts backward after `degree - pp_rank` forwards; the V schedules hold about
    `degree` per stage (1F1B's memory, the zero-bubble papers' claim); interleaved 1F1B
    warms up with Megatron's (degree - pp_rank - 1) x 2 + (stages_per_rank - 1) x degree
    forwards, spread over the rank's stages."""
    if schedule in ("GPipe", "LoopedBFS"):
        held = n_microbatches
    elif schedule == "1F1B":
        held = degree - pp_rank
    elif schedule in ("ZBVZeroBubble", "DualPipeV"):
        held = degree
    else:
        warmup = (degree - pp_rank - 1) * 2 + (stages_per_rank - 1) * degree + 1
        held = math.ceil(warmup / stages_per_rank)
    return max(1, min(n_microbatches, held))


@dataclass(frozen=True)
class FsdpWorkingSet:
    """Gathered (unsharded) weights and gradients FSDP holds at the peak, in bytes."""

    root: float  # non-block weights (embedding, output, final norm) and their gradients
    blocks: float  # blocks gathered at once, and one block's gradients being reduced

    @property
    def total(self) -> float:
        return self.root + self.blocks


def gathered_elements(param: torch.Tensor, dp_shard: int) -> int:
    """Elements of `param` FSDP all-gathers on this rank: local x dp_shard, or local x the
    efsdp ranks for expert-parallel experts (each rank gathers its own experts only)."""
    names = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else ()
    ranks = param.device_mesh.size(names.index("efsdp")) if "efsdp" in names else dp_shard
    return local_tensor(param).numel() * ranks


def estimate_fsdp(
    model: nn.Module, dp_shard: int, param_bytes: int, reduce_bytes: int, parallelism: Any
) -> FsdpWorkingSet:
    """Unsharded = local x dp_shard elements (`gathered_elements`), in the compute dtype. The root stays gathered
    from forward through backward and its gradients from the output layer's backward to the
    end; blocks are gathered one at a time plus the prefetched ones (all with "never", and in
    a pipeline stage, which keeps them between its microbatches' forwards and backwards)."""
    per_layer = [sum(gathered_elements(p, dp_shard) for p in layer.parameters()) for layer in model.layers.values()]
    root = sum(gathered_elements(p, dp_shard) for p in model.parameters()) - sum(per_layer)
    block = max(per_layer)
    in_flight = 1 + max(1, parallelism.fsdp_prefetch_depth)
    pipelined = parallelism.pipeline_parallel_degree > 1 and parallelism.fsdp_reshard_after_forward != "always"
    if parallelism.fsdp_reshard_after_forward == "never" or pipelined:
        in_flight = len(per_layer) + 1
    return FsdpWorkingSet(2 * root * param_bytes, block * (in_flight * param_bytes + max(param_bytes, reduce_bytes)))
