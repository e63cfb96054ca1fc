"""Muon for the hidden matrices, AdamW for the rest, over plain or DTensor parameters of any
placement on any mesh.

Muon (Keller Jordan; Moonlight, arXiv 2502.16982) replaces a matrix's momentum by its nearest
semi-orthogonal matrix (Newton-Schulz iterations, torch's own `torch.optim._muon` code, so one
process gives `torch.optim.Muon`'s numbers). That needs the WHOLE matrix, which FSDP, TP and
EP shard. Each matrix (each routed expert of a stacked [E, out, in] weight on its own) gets
one owner among the ranks that hold a piece of it, the owners balanced by matrix size; one
all-to-all brings every owner the pieces of its matrices, the owner orthogonalizes them, and a
second all-to-all sends each rank the block of the result its shard holds. No rank gathers a
matrix it does not own. Which rank holds which block comes from each DTensor's chunk (its
global offsets and sizes, as DCP records them), exchanged once.

Embeddings, the output head, norms and biases take AdamW (decoupled weight decay), as the
Muon papers do: a group's `algorithm` says which. All state (momentum buffers, AdamW moments)
is laid out like its parameter, so checkpoints reshard it as they do the weights.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

# Matrices that still take AdamW: the input embedding and the output head (Moonlight, Keller Jordan).
ADAMW_MATRICES = ("tok_embeddings.*", "output.*")
NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """Muon updates 2-D weights and stacked [E, out, in] expert weights, except the embedding and head."""
    return param.ndim in (2, 3) and not any(fnmatch.fnmatchcase(name, pattern) for pattern in ADAMW_MATRICES)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


MatrixKey = tuple[str, int | None]  # (parameter key, expert index of a stacked weight or None)


class Muon(torch.optim.Optimizer):
    """Muon (groups with `algorithm` "muon": 2-D or stacked 3-D parameters) and AdamW (the
    other groups). `names` maps id(parameter) to a name every rank gives the same parameter
    (its FQN); without it, parameters are numbered in order, which is right when every rank
    holds the same parameters (not under pipeline parallelism)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "original",
        names: Mapping[int, str] | None = None,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            algorithm="muon",
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["algorithm"] == "muon" and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError("Muon: a muon group holds a parameter that is not 2-D or stacked 3-D")
        ordered = [p for group in self.param_groups for p in group["params"]]
        self._keys = {id(p): names[id(p)] if names else f"param{i}" for i, p in enumerate(ordered)}
        self._plan: dict[MatrixKey, _Matrix] | None = None
        self.last_owned = 0  # matrices this rank orthogonalized in the last step
        self.last_gathered_bytes = 0  # bytes of other ranks' pieces it received for them

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_params = []
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw(group)
            else:
                muon_params += [(group, p) for p in group["params"]]
        self._muon(muon_params)
        return loss

    def _adamw(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            state["step"] += 1
            step = state["step"].item()
            grad = _local(_like_param(param.grad, param))
            exp_avg, exp_avg_sq, value = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), _local(param)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            value.mul_(1 - lr * weight_decay)
            denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
            value.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1**step))

    def _muon(self, params: list[tuple[dict, torch.Tensor]]) -> None:
        """Momentum per shard, Newton-Schulz per whole matrix on its owner, the update per shard."""
        updates: dict[int, torch.Tensor] = {}
        for group, param in params:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            grad = _local(_like_param(grad, param))
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            buffer = _local(state["momentum_buffer"])
            if param.grad is not None:
                buffer.lerp_(grad, 1 - group["momentum"])
            updates[id(param)] = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
        orthogonal = self._orthogonalize(params, updates)
        for group, param in params:
            if param.grad is None:
                continue
            lr = group["lr"]
            value = _local(param)
            value.mul_(1 - lr * group["weight_decay"])
            value.add_(orthogonal[id(param)], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape[-2:]))

    def _orthogonalize(
        self, params: list[tuple[dict, torch.Tensor]], updates: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Each parameter's local block of its orthogonalized update: plain tensors here, DTensors'
        matrices on their owners through the exchange."""
        result, distributed = {}, []
        for group, param in params:
            if isinstance(param, DTensor):
                distributed.append((group, param))
            else:
                result[id(param)] = _orthogonal(updates[id(param)], group["ns_steps"])
        if dist.is_initialized():  # every rank takes part in the exchange, holding DTensors or not
            result.update(self._exchange(distributed, updates))
        return result

    def _exchange(
        self, params: list[tuple[dict, DTensor]], updates: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        if self._plan is None:
            self._plan = _Plan.build([(self._keys[id(p)], p) for _, p in params])
        plan, rank = self._plan, dist.get_rank()
        blocks = {}  # this rank's block of each matrix it holds
        for group, param in params:
            key, update = self._keys[id(param)], updates[id(param)]
            first = plan.first_expert.get(key)
            for index in [None] if first is None else range(first, first + update.shape[0]):
                blocks[(key, index)] = update if index is None else update[index - first]
        ns_steps = {self._keys[id(p)]: group["ns_steps"] for group, p in params}
        owned = [k for k, m in plan.matrices.items() if m.owner == rank]
        # Gather: every rank sends each owner the distinct blocks it holds of the owner's matrices.
        gathered = plan.all_to_all(
            lambda key, m, sender, dest: sender == rank and m.owner == dest,
            lambda key, m, sender, source: sender == source and m.owner == rank,
            lambda key: blocks[key],
            use_senders=True,
        )
        results = {}
        for key in owned:
            matrix = plan.matrices[key]
            whole = torch.empty(matrix.shape, dtype=torch.float32)
            for (sender, row, col, rows, cols), piece in zip(matrix.senders, gathered[key]):
                whole[row : row + rows, col : col + cols] = piece.view(rows, cols)
            results[key] = _orthogonal(whole, ns_steps[key[0]])
        self.last_owned = len(owned)
        self.last_gathered_bytes = plan.last_received_bytes
        # Scatter: each owner sends every holder the block of the result its shard holds.
        scattered = plan.all_to_all(
            lambda key, m, holder, dest: m.owner == rank and holder == dest,
            lambda key, m, holder, source: m.owner == source and holder == rank,
            lambda key, block: results[key][block[1] : block[1] + block[3], block[2] : block[2] + block[4]],
            use_senders=False,
        )
        out = {}
        for _, param in params:
            key, update = self._keys[id(param)], updates[id(param)]
            first = plan.first_expert.get(key)
            if update.numel() == 0:
                out[id(param)] = update.clone()
            elif first is None:
                out[id(param)] = scattered[(key, None)][0].view_as(update)
            else:
                experts = range(first, first + update.shape[0])
                out[id(param)] = torch.stack([scattered[(key, e)][0].view_as(update[0]) for e in experts])
        return out


def _like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The gradient laid out as its parameter (a TP embedding's gradient can arrive Replicate)."""
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _orthogonal(update: torch.Tensor, ns_steps: int) -> torch.Tensor:
    """torch's Newton-Schulz (bfloat16, as torch.optim.Muon) of a matrix or of each matrix of a stack."""
    if update.ndim == 3:
        return torch.stack([_orthogonal(matrix, ns_steps) for matrix in update])
    return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, ns_steps, EPS).to(update.dtype)


Block = tuple[int, int, int, int, int]  # (rank, first row, first column, rows, columns) of a matrix


@dataclass
class _Matrix:
    """One whole matrix of the exchange: its shape, its owner, and the blocks ranks hold of it
    (`holders`: every rank's, `senders`: one rank per distinct block)."""

    shape: tuple[int, int]
    holders: list[Block] = field(default_factory=list)
    senders: list[Block] = field(default_factory=list)
    owner: int = -1


class _Plan:
    """Who holds which block of every matrix and who owns it: the same on every rank, built
    once from each rank's DTensor chunks (one all_gather_object over the world)."""

    def __init__(self, matrices: dict[MatrixKey, _Matrix], first_expert: dict[str, int]):
        self.matrices = dict(
            sorted(matrices.items(), key=lambda item: (item[0][0], -1 if item[0][1] is None else item[0][1]))
        )
        self.first_expert = first_expert  # this rank's first expert of each stacked weight it holds
        self.last_received_bytes = 0

    @classmethod
    def build(cls, params: list[tuple[str, DTensor]]) -> _Plan:
        mine = []
        for key, param in params:
            chunk = param.__create_chunk_list__()[0]
            mine.append((key, tuple(param.shape), tuple(chunk.offsets), tuple(chunk.sizes)))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        matrices: dict[MatrixKey, _Matrix] = {}
        for rank, chunks in enumerate(everyone):
            for key, shape, offsets, sizes in chunks:
                if 0 in sizes:
                    continue
                experts = [None] if len(shape) == 2 else range(offsets[0], offsets[0] + sizes[0])
                for index in experts:
                    matrix = matrices.setdefault((key, index), _Matrix(tuple(shape[-2:])))
                    block = (rank, offsets[-2], offsets[-1], sizes[-2], sizes[-1])
                    matrix.holders.append(block)
                    if all(b[1:] != block[1:] for b in matrix.senders):
                        matrix.senders.append(block)
        _assign_owners(matrices)
        first = {key: offsets[0] for key, shape, offsets, sizes in everyone[dist.get_rank()] if len(shape) == 3}
        return cls(matrices, first)

    def all_to_all(self, sends_to, receives_from, block_of, use_senders: bool) -> dict[MatrixKey, list[torch.Tensor]]:
        """One all_to_all_single over the world: this rank sends, to each rank, the blocks
        `sends_to(key, matrix, block rank, destination)` selects, in plan order, and returns
        the blocks `receives_from` selects, per matrix, in the order of its block list."""
        rank, world = dist.get_rank(), dist.get_world_size()
        outgoing, incoming = [[] for _ in range(world)], [[] for _ in range(world)]
        for key, matrix in self.matrices.items():
            for block in matrix.senders if use_senders else matrix.holders:
                for other in range(world):
                    if sends_to(key, matrix, block[0], other):
                        piece = block_of(key) if use_senders else block_of(key, block)
                        outgoing[other].append(piece.reshape(-1).float())
                    if receives_from(key, matrix, block[0], other):
                        incoming[other].append((key, block[3] * block[4]))
        sent = [sum(p.numel() for p in pieces) for pieces in outgoing]
        sizes = [sum(n for _, n in pieces) for pieces in incoming]
        buffer = torch.empty(sum(sizes))
        payload = torch.cat([p for pieces in outgoing for p in pieces]) if sum(sent) else torch.empty(0)
        dist.all_to_all_single(buffer, payload, sizes, sent)
        self.last_received_bytes = 4 * (sum(sizes) - sizes[rank])
        received: dict[MatrixKey, list[torch.Tensor]] = {}
        for pieces, part in zip(incoming, buffer.split(sizes)):
            for (key, _), piece in zip(pieces, part.split([n for _, n in pieces])):
                received.setdefault(key, []).append(piece)
        return received


def _assign_owners(matrices: dict[MatrixKey, _Matrix]) -> None:
    """Largest matrices first, each to the rank holding a block of it that owns the least work so far."""
    load: dict[int, float] = {}
    for key in sorted(matrices, key=lambda k: (-math.prod(matrices[k].shape), k[0], k[1] or 0)):
        matrix = matrices[key]
        ranks = sorted({block[0] for block in matrix.holders})
        matrix.owner = min(ranks, key=lambda r: (load.get(r, 0.0), r))
        load[matrix.owner] = load.get(matrix.owner, 0.0) + math.prod(matrix.shape) * min(matrix.shape)
