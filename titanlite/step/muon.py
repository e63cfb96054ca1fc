"""Muon for the hidden matrices, AdamW for the rest, over plain or DTensor parameters of any
placement on any mesh.

Muon (Keller Jordan; Moonlight, arXiv 2502.16982) replaces a matrix's momentum by its nearest
semi-orthogonal matrix (Newton-Schulz iterations: torch.optim.Muon's ops in its order and dtype,
written with public torch, so one process gives its numbers bit for bit). That needs the WHOLE
matrix, which FSDP, TP and EP shard. Each matrix (each routed expert of a stacked [E, out, in] weight on its own) gets
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

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.parallel.placement import local_tensor
from titanlite.step.local_shards import AdamW, like_param

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's defaults
NS_EPS = 1e-7  # the norm's floor before the iterations, torch.optim.Muon's default
BLOCKS = "layers."  # every model's transformer blocks (parallel/units.py, the pipeline split)


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """Muon updates the hidden matrices: the 2-D weights and stacked [E, out, in] expert weights
    inside the transformer blocks. What sits outside them (embeddings, the final norm, the
    output head: a model's first and last layers) and every 1-D parameter take AdamW, as the
    Muon papers do."""
    return param.ndim in (2, 3) and name.startswith(BLOCKS)


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
        settings = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
        super().__init__(params, {**settings, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn, "algorithm": "muon"})
        for group in self.param_groups:
            if group["algorithm"] == "muon" and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError("Muon: a muon group holds a parameter that is not 2-D or stacked 3-D")
        ordered = [p for group in self.param_groups for p in group["params"]]
        self._keys = {id(p): names[id(p)] if names else f"param{i}" for i, p in enumerate(ordered)}
        self._plan: _Plan | None = None
        self.last_owned = 0  # matrices this rank orthogonalized in the last step
        self.last_gathered_bytes = 0  # bytes of other ranks' pieces it received for them

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adamw_groups = [group for group in self.param_groups if group["algorithm"] == "adamw"]
        if adamw_groups:  # torch's AdamW (on local shards) over them and this state, its defaults filled in
            adamw = AdamW(adamw_groups, foreach=False)
            adamw.state = self.state
            adamw.step()
        self._muon([(group, p) for group in self.param_groups if group["algorithm"] == "muon" for p in group["params"]])
        return loss

    def _muon(self, params: list[tuple[dict, torch.Tensor]]) -> None:
        """Momentum per shard, Newton-Schulz per whole matrix on its owner, the update per shard."""
        updates: dict[int, torch.Tensor] = {}
        for group, param in params:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            grad = local_tensor(like_param(grad, param))
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            buffer = local_tensor(state["momentum_buffer"])
            if param.grad is not None:
                buffer.lerp_(grad, 1 - group["momentum"])
            updates[id(param)] = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
        # Each parameter's local block of its orthogonalized update: plain tensors here, DTensors'
        # matrices on their owners through the exchange.
        orthogonal = {
            id(p): _orthogonal(updates[id(p)], group["ns_steps"]) for group, p in params if not isinstance(p, DTensor)
        }
        self.last_owned = sum(u.shape[0] if u.ndim == 3 else 1 for u in orthogonal.values())
        self.last_gathered_bytes = 0
        if dist.is_initialized():  # every rank takes part in the exchange, holding DTensors or not
            orthogonal.update(self._exchange([(g, p) for g, p in params if isinstance(p, DTensor)], updates))
        for group, param in params:
            if param.grad is None:
                continue
            lr = group["lr"]
            value = local_tensor(param)
            value.mul_(1 - lr * group["weight_decay"])
            value.add_(orthogonal[id(param)], alpha=-lr * _lr_scale(group["adjust_lr_fn"], *param.shape[-2:]))

    def _exchange(
        self, params: list[tuple[dict, DTensor]], updates: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        if self._plan is None:
            self._plan = _Plan.build([(self._keys[id(p)], p) for _, p in params])
        plan = self._plan
        held = {id(p): _matrices(self._keys[id(p)], updates[id(p)], plan.first_expert) for _, p in params}
        blocks = {key: block for pairs in held.values() for key, block in pairs}  # this rank's block of each matrix
        ns_steps = {self._keys[id(p)]: group["ns_steps"] for group, p in params}
        # Gather: every rank sends each owner the distinct blocks it holds of the owner's matrices.
        outgoing = [[blocks[key] for key, _ in sends] for sends in plan.gather_out]
        gathered, self.last_gathered_bytes = _all_to_all(outgoing, plan.gather_in)
        results = {key: torch.empty(plan.matrices[key].shape) for key in plan.owned}
        for key, (_, row, col, rows, cols), piece in gathered:
            results[key][row : row + rows, col : col + cols] = piece.view(rows, cols)
        for key, whole in results.items():
            results[key] = _orthogonal(whole, ns_steps[key[0]])
        self.last_owned += len(plan.owned)
        # Scatter: each owner sends every holder the block of the result its shard holds.
        outgoing = [
            [results[key][row : row + rows, col : col + cols] for key, (_, row, col, rows, cols) in sends]
            for sends in plan.scatter_out
        ]
        scattered = {key: piece for key, _, piece in _all_to_all(outgoing, plan.scatter_in)[0]}
        out = {}
        for i, pairs in held.items():  # an empty shard holds no block: nothing was sent to it
            whole = [scattered[key].view_as(block) for key, block in pairs]
            out[i] = torch.stack(whole).view_as(updates[i]) if updates[i].numel() else updates[i].clone()
        return out


def _matrices(key: str, update: torch.Tensor, first_expert: dict[str, int]) -> list[tuple[MatrixKey, torch.Tensor]]:
    """(matrix, this rank's block of it) of each matrix in a parameter's update: the update
    itself, or each expert of a stacked weight (`first_expert`: this rank's first of each)."""
    if key not in first_expert:
        return [((key, None), update)]
    return [((key, first_expert[key] + index), matrix) for index, matrix in enumerate(update)]


def _orthogonal(update: torch.Tensor, ns_steps: int) -> torch.Tensor:
    """The Newton-Schulz iteration of a matrix, or of each matrix of a stack, in bfloat16 and in
    the update's dtype after: torch.optim.Muon's ops in its order (torch 2.13's
    `_zeropower_via_newtonschulz`), so its numbers bit for bit (tests/unit/test_muon.py)."""
    if update.ndim == 3:
        return torch.stack([_orthogonal(matrix, ns_steps) for matrix in update])
    a, b, c = NS_COEFFICIENTS
    tall = update.size(0) > update.size(1)
    ortho = update.bfloat16().T if tall else update.bfloat16()
    ortho.div_(ortho.norm().clamp(min=NS_EPS))  # the spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return (ortho.T if tall else ortho).to(update.dtype)


def _lr_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The per-matrix lr factor of torch.optim.Muon's `adjust_lr_fn`: "original" (Keller Jordan)
    or "match_rms_adamw" (Moonlight: the update's RMS matches AdamW's)."""
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


Block = tuple[int, int, int, int, int]  # (rank, first row, first column, rows, columns) of a matrix
Route = list[list[tuple[MatrixKey, Block]]]  # per rank: the (matrix, block) pairs sent to it or from it, in order


@dataclass
class _Matrix:
    """One whole matrix of the exchange: its shape, its owner, and the blocks ranks hold of it
    (`holders`: every rank's, `senders`: one rank per distinct block)."""

    shape: tuple[int, int]
    holders: list[Block] = field(default_factory=list)
    senders: list[Block] = field(default_factory=list)
    owner: int = -1


class _Plan:
    """Who holds which block of every matrix and who owns it, the same on every rank, built once
    from each rank's DTensor chunks (one all_gather_object over the world); and what this rank
    sends to and receives from each rank in the two all-to-alls of a step, in one fixed order."""

    def __init__(self, matrices: dict[MatrixKey, _Matrix], rank: int, world: int, first_expert: dict[str, int]):
        self.matrices = matrices
        self.first_expert = first_expert  # this rank's first expert of each stacked weight it holds
        self.owned = [key for key, matrix in matrices.items() if matrix.owner == rank]
        # The gather moves each distinct block from its holder to the owner; the scatter, every
        # holder's block from the owner to it: (matrix, block, from rank, to rank).
        gather = [(key, block, block[0], m.owner) for key, m in matrices.items() for block in m.senders]
        scatter = [(key, block, m.owner, block[0]) for key, m in matrices.items() for block in m.holders]
        self.gather_out, self.gather_in = _routes(gather, rank, world)
        self.scatter_out, self.scatter_in = _routes(scatter, rank, world)

    @classmethod
    def build(cls, params: list[tuple[str, DTensor]]) -> _Plan:
        chunks = [(key, param.shape, param.__create_chunk_list__()[0]) for key, param in params]
        mine = [(key, tuple(shape), tuple(chunk.offsets), tuple(chunk.sizes)) for key, shape, chunk in chunks]
        rank, world = dist.get_rank(), dist.get_world_size()
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        matrices: dict[MatrixKey, _Matrix] = {}
        for holder, chunks in enumerate(everyone):
            for key, shape, offsets, sizes in chunks:
                if 0 in sizes:
                    continue
                experts = [None] if len(shape) == 2 else range(offsets[0], offsets[0] + sizes[0])
                for index in experts:
                    matrix = matrices.setdefault((key, index), _Matrix(tuple(shape[-2:])))
                    block = (holder, offsets[-2], offsets[-1], sizes[-2], sizes[-1])
                    matrix.holders.append(block)
                    if all(other[1:] != block[1:] for other in matrix.senders):  # a replica sends once
                        matrix.senders.append(block)
        _assign_owners(matrices)
        first = {key: offsets[0] for key, shape, offsets, _ in everyone[rank] if len(shape) == 3}
        return cls(matrices, rank, world, first)  # every rank built `matrices` in one order, from `everyone`


def _routes(moves: list[tuple[MatrixKey, Block, int, int]], rank: int, world: int) -> tuple[Route, Route]:
    """What this rank sends to each rank, and receives from each, of `moves`, in their order."""
    out: Route = [[] for _ in range(world)]
    into: Route = [[] for _ in range(world)]
    for key, block, source, target in moves:
        if source == rank:
            out[target].append((key, block))
        if target == rank:
            into[source].append((key, block))
    return out, into


def _all_to_all(
    outgoing: list[list[torch.Tensor]], incoming: list[list[tuple[MatrixKey, Block]]]
) -> tuple[list[tuple[MatrixKey, Block, torch.Tensor]], int]:
    """One all_to_all_single over the world: `outgoing[r]`, flattened in order, to rank r; from
    each rank r the blocks `incoming[r]` lists. Returns (matrix, block, flat piece) for each
    received block, and the bytes received from other ranks."""
    rank = dist.get_rank()
    sent = [sum(piece.numel() for piece in pieces) for pieces in outgoing]
    sizes = [sum(block[3] * block[4] for _, block in expected) for expected in incoming]
    flat = [piece.reshape(-1).float() for pieces in outgoing for piece in pieces]
    buffer = torch.empty(sum(sizes))
    dist.all_to_all_single(buffer, torch.cat(flat) if flat else torch.empty(0), sizes, sent)
    expected = [(key, block) for blocks in incoming for key, block in blocks]
    pieces = buffer.split([block[3] * block[4] for _, block in expected])
    return [(key, block, piece) for (key, block), piece in zip(expected, pieces)], 4 * (sum(sizes) - sizes[rank])


def _assign_owners(matrices: dict[MatrixKey, _Matrix]) -> None:
    """Largest matrices first, each to the rank holding a block of it that owns the least work so far."""
    load: dict[int, float] = {}
    for key in sorted(matrices, key=lambda k: (-math.prod(matrices[k].shape), k[0], k[1] or 0)):
        matrix = matrices[key]
        matrix.owner = min({block[0] for block in matrix.holders}, key=lambda r: (load.get(r, 0.0), r))
        load[matrix.owner] = load.get(matrix.owner, 0.0) + math.prod(matrix.shape) * min(matrix.shape)
