"""titanlite/parallel/grad_norm.py on one process: the total norm of plain gradients equals a
float64 reference, clipping scales to max_norm and leaves small norms alone, 0 only measures;
on a one-rank gloo mesh, Replicate and Shard(0) DTensor gradients count once, and a Partial
gradient of a replicated weight is summed (a real all-reduce) into the parameter's placement."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from titanlite.parallel.grad_norm import clip_gradients_, total_grad_norm


def params_with_grads(*shapes: tuple[int, ...], scale: float = 1.0) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape) * scale
    return params


def reference_norm(params) -> float:
    return torch.cat([p.grad.double().flatten() for p in params if p.grad is not None]).norm().item()


def test_total_norm_equals_the_float64_norm_and_skips_missing_grads():
    params = params_with_grads((300, 7), (5,), (2, 3, 4))
    params.append(torch.nn.Parameter(torch.ones(3)))  # no grad: left out
    assert total_grad_norm(params, world=False).item() == pytest.approx(reference_norm(params), rel=1e-6)


def test_clipping_scales_to_max_norm_and_leaves_small_norms_alone():
    params = params_with_grads((50, 4), (10,), scale=3.0)
    before = reference_norm(params)
    norm = clip_gradients_(params, max_norm=1.0, world=False)
    assert norm.item() == pytest.approx(before, rel=1e-6) and reference_norm(params) == pytest.approx(1.0, rel=1e-5)
    small = params_with_grads((4,), scale=1e-3)
    grads = [p.grad.clone() for p in small]
    clip_gradients_(small, max_norm=1.0, world=False)
    assert all(torch.equal(p.grad, g) for p, g in zip(small, grads))
    measured = params_with_grads((8, 8), scale=5.0)
    grads = [p.grad.clone() for p in measured]
    clip_gradients_(measured, max_norm=0.0, world=False)
    assert all(torch.equal(p.grad, g) for p, g in zip(measured, grads))


def test_dtensor_gradients_count_each_element_once():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = params_with_grads((6, 4), (8,))
        sharded = [
            torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement]))
            for p, placement in zip(plain, (Shard(0), Replicate()))
        ]
        for p, q in zip(sharded, plain):
            p.grad = distribute_tensor(q.grad, mesh, p.placements)
        assert total_grad_norm(sharded, world=True).item() == pytest.approx(reference_norm(plain), rel=1e-6)
    finally:
        dist.destroy_process_group()


def test_no_gradients_and_no_process_group():
    assert total_grad_norm([torch.nn.Parameter(torch.ones(3))], world=True).item() == 0.0
    params = params_with_grads((7, 3))
    assert total_grad_norm(params, world=True).item() == pytest.approx(
        reference_norm(params), rel=1e-6
    )  # no group: local


def test_a_partial_gradient_is_summed_into_the_parameters_placement():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        (plain,) = params_with_grads((5, 3))
        param = torch.nn.Parameter(distribute_tensor(plain.detach(), mesh, [Replicate()]))
        param.grad = DTensor.from_local(plain.grad.clone(), mesh, [Partial()], run_check=False)
        norm = total_grad_norm([param], world=True)
        assert param.grad.placements == (Replicate(),) and torch.equal(param.grad.to_local(), plain.grad)
        assert norm.item() == pytest.approx(reference_norm([plain]), rel=1e-6)
    finally:
        dist.destroy_process_group()
