"""One forward of the decoding loop over this rank's share of the model: the whole model, or
its pipeline stages run in stage order with the activations sent from rank to rank (the
package docstring says why no pipelining schedule drives them)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.generate.load import LoadedModel
from titanlite.logging import logger
from titanlite.models.kv_cache import KVCache
from titanlite.parallel.pipeline import wait_with_timeout
from titanlite.step.precision import autocast_dtype


class StageForward:
    """tokens [batch, seq] -> the last position's logits [batch, vocab] on the ranks that hold
    the model's output, None on the others. Every rank calls it with the same tokens.

    Stage s runs on the pp rank that holds it (`holders[s]`); when stage s + 1 sits on
    another rank, the activations go there with a send on the pp group: their shape, then
    the tensor in float32, which every compute dtype casts to and back exactly (a stage
    under FSDP mixed precision casts its input to the compute dtype, as in one process)."""

    def __init__(self, loaded: LoadedModel, device: torch.device):
        plan, layout, meshes = loaded.plan, loaded.plan.pipeline, loaded.meshes
        self.spec, self.device = plan.spec, device
        if layout is None:
            self.pp_rank, self.group, self.holders, self.output_rank = 0, None, [0], 0
            held = (0,)
        else:
            self.pp_rank, self.group = meshes.pp.get_local_rank(), meshes.pp.get_group()
            self.holders = [layout.holder(stage) for stage in range(len(layout.stages))]
            # The rank that samples: the lowest global rank that holds the output.
            self.output_rank = layout.output_rank(meshes.world)
            held = layout.stage_indices(self.pp_rank)
        self.stages = dict(zip(held, loaded.parts))
        # as the trainer does
        self.autocast_dtype = autocast_dtype(plan.cfg.training.mixed_precision_param, plan.dims.fsdp_enabled)
        self.caches: list[KVCache] = []

    def enable_kv_cache(self, max_len: int) -> bool:
        """Give each of this rank's stages a KV cache of `max_len` tokens per row; False (and a
        log line) for a model that has none."""
        if not self.spec.supports("kv_cache"):
            logger.info(f"generate: model {self.spec.name} has no KV cache; each token recomputes the whole sequence")
            return False
        for part in self.stages.values():
            self.caches.append(KVCache(max_len))
            part.enable_kv_cache(self.caches[-1])
        return True

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor | None:
        h = tokens
        autocast = self.autocast_dtype is not None
        with torch.autocast(self.device.type, dtype=self.autocast_dtype) if autocast else contextlib.nullcontext():
            for stage in sorted(self.stages):  # this rank's, in stage order
                if stage > 0 and self.holders[stage - 1] != self.pp_rank:
                    h = self._receive(self.holders[stage - 1])
                h = self.stages[stage](h)
                if stage + 1 < len(self.holders) and self.holders[stage + 1] != self.pp_rank:
                    self._send(h, self.holders[stage + 1])
        for cache in self.caches:
            cache.advance(tokens.shape[1])
        if self.holders[-1] != self.pp_rank:
            return None
        logits = h[:, -1]
        return logits.full_tensor() if isinstance(logits, DTensor) else logits  # vocab-sharded under loss parallel

    def _send(self, h: torch.Tensor, holder: int) -> None:
        peer = dist.get_global_rank(self.group, holder)
        shape, data = torch.tensor(h.shape, device=h.device), h.float().contiguous()
        wait_with_timeout([dist.isend(shape, peer, group=self.group), dist.isend(data, peer, group=self.group)])

    def _receive(self, holder: int) -> torch.Tensor:
        peer = dist.get_global_rank(self.group, holder)
        shape = torch.empty(3, dtype=torch.long, device=self.device)
        wait_with_timeout([dist.irecv(shape, peer, group=self.group)])
        data = torch.empty(shape.tolist(), dtype=torch.float32, device=self.device)
        wait_with_timeout([dist.irecv(data, peer, group=self.group)])
        return data
