"""Validation through the real trainer (gloo, fp32, debug model, the held-out split of the
built-in corpus): logged at the configured steps on the console and in TensorBoard, the
same loss under every layout, and training losses identical with validation on or off.
(That the held-out windows are disjoint from training: tests/unit/test_corpus.py.)"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import EQUIVALENCE_ARGS, read_tensorboard, run_ranks, with_overrides

VALIDATION = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]
# 5 steps, not EQUIVALENCE_ARGS' 3: validation follows its step's update, and the last step's is at
# lr 0 (the schedule's end), so at 3 steps the last validation would see step 2's weights again.
ARGS = with_overrides(EQUIVALENCE_ARGS, ["--training.steps", "5", "--metrics.enable_tensorboard", "true"])
LAYOUTS = {  # global batch 8 everywhere
    "single": (1, ["--training.local_batch_size", "8"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
}


def train(tmp_path_factory, layout: str, validation: bool) -> tuple[str, dict]:
    nproc, overrides = LAYOUTS[layout]
    dump = tmp_path_factory.mktemp(f"{layout}-{'val' if validation else 'noval'}")
    args = ARGS + overrides + (VALIDATION if validation else []) + ["--job.dump_folder", str(dump)]
    result = run_ranks(nproc, ["-m", "titanlite.train"], args, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, read_tensorboard(dump / "tb")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    return {
        "fsdp2": train(tmp_path_factory, "fsdp2", True),
        "fsdp2_off": train(tmp_path_factory, "fsdp2", False),
        "tp2": train(tmp_path_factory, "tp2", True),
        "single": train(tmp_path_factory, "single", True),
    }


@pytest.mark.timeout(900)
def test_validation_is_logged_at_the_configured_steps(runs):
    stdout, scalars = runs["fsdp2"]
    assert [s for s, _ in scalars["validation/loss"]] == [2, 4, 5]  # every 2 steps and the last
    assert [s for s, _ in scalars["validation/perplexity"]] == [2, 4, 5]
    lines = [line for line in stdout.splitlines() if "validation step" in line]
    assert len(lines) == 3 and "perplexity" in lines[0]
    for step, loss in scalars["validation/loss"]:
        assert f"validation step {step:>5}  loss {loss:7.4f}" in stdout
    assert "validation/loss" not in runs["fsdp2_off"][1]


@pytest.mark.timeout(900)
def test_training_losses_are_the_same_with_validation_on_or_off(runs):
    on, off = runs["fsdp2"][1], runs["fsdp2_off"][1]
    assert on["loss"] == off["loss"] and on["grad_norm"] == off["grad_norm"]  # exact, every step


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["tp2", "single"])
def test_validation_loss_is_the_same_under_every_layout(runs, layout):
    reference, ours = runs["fsdp2"][1]["validation/loss"], runs[layout][1]["validation/loss"]
    assert [s for s, _ in ours] == [s for s, _ in reference]
    for (step, want), (_, got) in zip(reference, ours):
        assert got == pytest.approx(want, rel=1e-5), f"{layout} step {step}"
    assert reference[-1][1] < reference[0][1]  # the model learns, validation sees it
