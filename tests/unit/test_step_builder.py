"""The step builder (step/builder.py) on one process, and the pipeline loss's arguments
passed with each schedule call (forward_backward.StepLoss), with and without torch's
`loss_kwargs`. The multi-process layouts are tests/runs/test_parallel_equivalence.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from titanlite.config import load_config
from titanlite.parallel.mesh import Meshes, ParallelDims
from titanlite.parallel.pipeline_plan import plan_layout
from titanlite.step.builder import StepBuilder
from titanlite.step.forward_backward import StepLoss, Unpipelined
from titanlite.step.loss import cross_entropy

CPU = torch.device("cpu")


def builder(*overrides: str) -> StepBuilder:
    cfg = load_config(["--config", "debug_model", *overrides])
    return StepBuilder.for_run(
        cfg,
        dims=ParallelDims.from_config(cfg.parallelism, 1),
        pipeline=None,
        meshes=Meshes(None, None, None, None),
        device=CPU,
        rank=0,
    )


def test_one_process_gets_the_whole_model_runner_with_its_compute_context_and_document_flag():
    plain = builder("--training.mixed_precision_param", "float32")
    assert not plain.documents and plain.autocast is None and plain.loss_rank == 0
    model = torch.nn.Linear(2, 2)
    runner = plain.forward_backward(model, [model])
    assert isinstance(runner, Unpipelined) and runner.context_parallel is None and runner.nan_fault_here
    assert plain.reported(torch.tensor(2.5)) == 2.5
    documents = builder("--training.mixed_precision_param", "bfloat16", "--model.attn_mask_type", "block_causal")
    assert documents.documents and documents.autocast == torch.bfloat16  # no FSDP to cast: autocast
    with documents.compute_context():
        assert torch.is_autocast_enabled("cpu")


def test_the_loss_rank_is_the_lowest_global_rank_holding_the_last_stage():
    world = SimpleNamespace(mesh=torch.arange(8).reshape(2, 2, 2))  # pp 2 outermost, then 2 x 2
    for schedule, pp_rank in (("1F1B", 1), ("ZBVZeroBubble", 0)):
        parallelism = load_config(
            [
                "--config",
                "debug_model",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                schedule,
            ]
        ).parallelism
        layout = plan_layout(parallelism, 6, 4)
        assert layout.last_stage_pp_rank() == pp_rank and layout.output_rank(world) == 4 * pp_rank


class Schedule:
    """A stand-in schedule that computes the loss of one microbatch as torch's does: with the
    call's `loss_kwargs` where torch has them (2.13), without (2.11)."""

    def __init__(self, loss_fn, takes_loss_kwargs: bool):
        self.loss_fn = loss_fn
        self.step = self._step if takes_loss_kwargs else self._step_without

    def _step(self, logits, target=None, loss_kwargs=None):
        return self.loss_fn(logits, target, **(loss_kwargs or {}))

    def _step_without(self, logits, target=None):
        return self.loss_fn(logits, target)


@pytest.mark.parametrize("takes_loss_kwargs", [True, False])
def test_the_pipeline_loss_takes_its_scale_and_step_from_each_call(takes_loss_kwargs, monkeypatch):
    logits, labels = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    loss = StepLoss(nan_fault_here=True)
    schedule = Schedule(loss, takes_loss_kwargs)
    with loss.passing(schedule, 0.25, 3, None) as arguments:
        assert schedule.step(logits, target=labels, **arguments) == cross_entropy(logits, labels) * 0.25
    assert loss._held is None  # nothing outlives the call
    monkeypatch.setenv("TITANLITE_FAULT_NAN_AT_STEP", "3")
    with loss.passing(schedule, 0.25, 3, None) as arguments:
        assert schedule.step(logits, target=labels, **arguments).isnan()
