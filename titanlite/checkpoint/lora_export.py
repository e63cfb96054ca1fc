"""A LoRA run's `last_save_in_hf` (`lora.save`): its adapters as a PEFT adapter folder, or the
model with its adapters merged into the weights as a Hugging Face folder.

- **adapters**: `adapter_config.json` and `adapter_model.safetensors` as PEFT writes them, which
  `peft.PeftModel.from_pretrained(base, folder)` loads onto the transformers base model: each
  adapter under `base_model.model.<HF name of its linear>.lora_A.weight` / `lora_B.weight`, a
  q/k projection's B in HF's rotate-half row order (its rows are the weight's). The adapters are
  small (rank x width per linear), so each is gathered whole and rank 0 writes the one file.
- **merged**: W + (alpha / rank) B A, computed by each rank for its own shard of W (from the
  whole A and B), then written by every rank as any model (`hf_io.save_hf_weights`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.checkpoint.export import cast_floating
from titanlite.checkpoint.hf_plan import local_chunks
from titanlite.model_spec import DecoderArgs, HFAdapter
from titanlite.parallel.lora import is_adapter
from titanlite.parallel.placement import local_tensor, shard_like

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def _whole(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective over its mesh for a DTensor)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _bases(state: dict[str, Any]) -> list[str]:
    """The adapted linears, by the name their weight's key starts with, in one order on every rank."""
    return sorted({key.rsplit(".", 1)[0] for key in state if is_adapter(key)})


@torch.no_grad()
def merged_state(state: dict[str, Any], scale: float) -> dict[str, Any]:
    """`state` (our keys, this rank's shards) with each adapted weight W replaced by
    W + scale B A on this rank's shard of W, and the adapters left out."""
    merged = {key: value for key, value in state.items() if not is_adapter(key)}
    for base in _bases(state):
        weight, a, b = state[f"{base}.weight"], _whole(state[f"{base}.lora_a"]), _whole(state[f"{base}.lora_b"])
        local = local_tensor(weight)
        chunks = local_chunks(weight)
        if not chunks or local.numel() == 0:
            continue
        (rows, cols), (n_rows, n_cols) = chunks[0].offsets, chunks[0].sizes
        delta = b[rows : rows + n_rows] @ a[:, cols : cols + n_cols]
        new = local + scale * delta.to(local.dtype)
        merged[f"{base}.weight"] = shard_like(new, weight) if isinstance(weight, DTensor) else new
    return merged


def peft_tensors(state: dict[str, Any], adapter: HFAdapter, args: DecoderArgs) -> dict[str, torch.Tensor]:
    """This rank's adapters, whole, under PEFT's names (a collective over each adapter's mesh)."""
    out = {}
    for base in _bases(state):
        hf = adapter.hf_name(f"{base}.weight").removesuffix(".weight")
        b = _whole(state[f"{base}.lora_b"]).detach().cpu()
        if heads := adapter.rotary_heads(f"{base}.weight", args):
            b = adapter.interleaved_to_half(b, heads)
        out[f"base_model.model.{hf}.lora_A.weight"] = _whole(state[f"{base}.lora_a"]).detach().cpu()
        out[f"base_model.model.{hf}.lora_B.weight"] = b
    return out


def peft_config(settings: Any, names: list[str], base_model: str) -> dict[str, Any]:
    """PEFT's `LoraConfig` of the `[lora]` section (`settings`), targets by their HF names."""
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def save_peft_adapter(
    state: dict[str, Any],
    out_dir: str | os.PathLike,
    adapter: HFAdapter,
    args: DecoderArgs,
    settings: Any,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    base_model: str = "",
) -> Path:
    """Write the adapters of `state` (our keys; plain tensors or this rank's shards) as a PEFT
    folder `out_dir`: every rank gathers its stage's adapters, rank 0 writes them all. Collective."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = cast_floating(peft_tensors(state, adapter, args), dtype)
    if group is not None and dist.get_world_size(group) > 1:
        everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(everyone, tensors, group=group)
        tensors = {name: value for stage in everyone for name, value in stage.items()}
    if group is None or dist.get_rank(group) == 0:
        partial = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, partial / PEFT_WEIGHTS_FILE, {"format": "pt"})
        config = peft_config(settings, list(tensors), base_model)
        (partial / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(partial, out_dir)
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
    return out_dir
