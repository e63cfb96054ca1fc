"""Layout-independent weight initialization.

Every rank draws each parameter's *full* tensor from one generator seeded with
`training.seed`, in module order, then keeps only its own shard. So a model initialized
on 1 process, on FSDP 2, on TP 2 or on any mesh holds exactly the same weights, which is
what lets the parallel layouts be tested against a single-process reference. The cost is
one full-size temporary per parameter at start-up; for very large models start from a seed
checkpoint (`checkpoint.create_seed_checkpoint`) instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


class InitStream:
    """A seeded stream of initializers that write into plain or DTensor parameters."""

    def __init__(self, seed: int, device: torch.device | str):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)
        self.generator.manual_seed(seed)

    def normal(self, param: torch.Tensor, std: float) -> None:
        self._fill(param, lambda t: torch.nn.init.normal_(t, 0.0, std, generator=self.generator))

    def trunc_normal(self, param: torch.Tensor, std: float, a: float = -2.0, b: float = 2.0) -> None:
        self._fill(param, lambda t: torch.nn.init.trunc_normal_(t, 0.0, std, a, b, generator=self.generator))

    def ones(self, param: torch.Tensor) -> None:
        self._fill(param, torch.nn.init.ones_)

    def zeros(self, param: torch.Tensor) -> None:
        self._fill(param, torch.nn.init.zeros_)

    def _fill(self, param: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
        full = torch.empty(param.shape, dtype=torch.float32, device=self.device)
        init(full)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor, so each just
            # slices its own shard with no communication.
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(full)
        else:
            param.copy_(full)
