"""float8 under FSDP, one rank's part: `run_checks` runs as a case of test_parallel_equivalence.py's
2-rank session (session_worker.py), no process start of its own.

The same two-linear model, from one seed, converted to float8 by `parallelize(float8=...)` and
sharded over both ranks, with and without `enable_fsdp_float8_all_gather`: what each linear
sees as its weight in forward (FSDP's gathered parameter) and the outputs. Then, with float8
all-gather, an optimizer step and `precompute_scales`: the scale each weight's next gather
will use, against the one the whole weight gives (float8's largest value over its amax).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from titanlite.config import Float8
from titanlite.parallel.float8 import precompute_scales
from titanlite.parallel.parallelize import parallelize

DIM = 64


def _model(all_gather: bool, mesh) -> nn.Module:
    torch.manual_seed(0)
    # biases: a unit of float8 weights alone cannot gather on gloo (float8.refuse_float8_only_units)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
    settings = Float8(filter_fqns=[], enable_fsdp_float8_all_gather=all_gather)
    return parallelize(model, mesh, fsdp_modules=[nn.Linear], float8=settings)


def _gathered(model: nn.Module) -> list[dict]:
    """What each linear computes with in forward: FSDP's all-gathered parameter."""
    seen: list[dict] = []

    def record(module: nn.Module, _inputs) -> None:
        weight = module.weight
        data = getattr(weight, "_data", weight)  # a Float8TrainingTensor keeps its float8 bytes in _data
        seen.append(
            {"type": type(weight).__name__, "dtype": str(data.dtype), "bytes": data.numel() * data.element_size()}
        )

    handles = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, nn.Linear)]
    torch.manual_seed(1)
    model(torch.randn(8, DIM))
    for handle in handles:
        handle.remove()
    return seen


def _scales(model: nn.Module) -> list[float | None]:
    """The scale each linear's next float8 all-gather will use (None: computed at the gather)."""
    return [
        None if m.weight._local_tensor._precomputed_scale is None else float(m.weight._local_tensor._precomputed_scale)
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]


def _stepped(mesh) -> tuple[nn.Module, torch.Tensor]:
    """The float8-gathering model after one SGD step, and its input."""
    model = _model(True, mesh)
    torch.manual_seed(1)
    x = torch.randn(8, DIM)
    model(x).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model, x


def _precompute(mesh) -> dict:
    precomputed, x = _stepped(mesh)
    dynamic, _ = _stepped(mesh)  # the same model, its scales computed at each gather
    before = _scales(precomputed)
    expected = [
        torch.finfo(torch.float8_e4m3fn).max / m.weight.full_tensor().abs().max().item()
        for m in precomputed.modules()
        if isinstance(m, nn.Linear)
    ]
    precompute_scales([precomputed])
    return {
        "before": before,
        "scale_errors": [abs(s / e - 1) for s, e in zip(_scales(precomputed), expected)],
        "out_vs_dynamic": float((precomputed(x) - dynamic(x)).detach().abs().max()),
    }


def run_checks() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    torch.manual_seed(1)
    x = torch.randn(8, DIM)
    outputs = {}
    result: dict = {}
    for all_gather in (False, True):
        model = _model(all_gather, mesh)
        result[f"all_gather_{all_gather}"] = _gathered(model)
        outputs[all_gather] = model(x).detach()
    result["out_difference"] = float((outputs[True] - outputs[False]).abs().max())
    result["precompute"] = _precompute(mesh)
    return result
