"""The programs in examples/, each run through torchrun on 2 gloo processes and checked
against the same loop on one process (losses to 1e-5 in float32): own_loop.py (its own model,
a TP plan then FSDP2, the checkpointer resuming across the two layouts), fsdp1_style.py (the
FSDP1 wrapper: full checkpoint into unwrapped and rewrapped models, sharded save and load),
megatron_style.py (nested submodule classes sharded; a full state dict from rank 0 into a
plain and a resharded model)."""

from __future__ import annotations

import re
import sys

from tests.helpers.commands import LAUNCHER_ENV, Run, run_command
from tests.helpers.distributed import run_env
from tests.helpers.token_data import make_prepared

LOSS = re.compile(r"^step (\d+) loss (\S+)", re.MULTILINE)


def torchrun(script: str, *args: str) -> Run:
    return run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        f"examples/{script}", *args], run_env())


def one_process(script: str, *args: str) -> Run:
    env = {k: v for k, v in run_env().items() if k not in LAUNCHER_ENV}
    return run_command([sys.executable, f"examples/{script}", *args], env)


def losses(run: Run) -> dict[int, float]:
    assert run.returncode == 0, run.describe()
    found = {int(step): float(loss) for step, loss in LOSS.findall(run.stdout)}
    assert found, run.describe()
    return found


def assert_same_losses(got: dict[int, float], reference: dict[int, float]) -> None:
    assert got.keys() == reference.keys(), (got, reference)
    worst = max(abs(got[s] - reference[s]) / max(1.0, abs(reference[s])) for s in got)
    assert worst <= 1e-5, (got, reference)


def test_own_loop_trains_with_a_tp_plan_then_resumes_under_fsdp_like_one_process(tmp_path):
    data = str(make_prepared(tmp_path / "tokens", 16 * 200).folder)
    reference = losses(one_process("own_loop.py", "--data", data, "--steps", "6"))
    ckpt = str(tmp_path / "ckpt")
    first = losses(torchrun("own_loop.py", "--data", data, "--steps", "3", "--tp", "2", "--ckpt", ckpt))
    resumed = losses(torchrun("own_loop.py", "--data", data, "--steps", "6", "--ckpt", ckpt))
    assert sorted(resumed) == [4, 5, 6]  # resumed at step 3's checkpoint, saved at tp 2, loaded at FSDP 2
    assert_same_losses({**first, **resumed}, reference)


def test_fsdp1_style_trains_like_one_process_and_its_checkpoints_load_anywhere(tmp_path):
    reference = losses(one_process("fsdp1_style.py", "--out", str(tmp_path / "one")))
    run = torchrun("fsdp1_style.py", "--out", str(tmp_path / "two"))
    assert_same_losses(losses(run), reference)
    match = re.search(r"unwrapped logits differ by (\S+), rewrapped by (\S+); sharded checkpoint: by (\S+)", run.stdout)
    assert match, run.describe()
    assert all(float(diff) <= 1e-6 for diff in match.groups()), match.group(0)


def test_megatron_style_shards_nested_classes_and_trains_like_one_process():
    reference = losses(one_process("megatron_style.py"))
    run = torchrun("megatron_style.py")
    assert_same_losses(losses(run), reference)
    units = re.search(r"FSDP units: (.*)", run.stdout).group(1)
    assert "decoder.0._checkpoint_wrapped_module.attention" in units and "embedding" in units, units
    match = re.search(r"full state dict: plain model differs by (\S+), resharded model by (\S+)", run.stdout)
    assert match and all(float(diff) <= 1e-6 for diff in match.groups()), run.describe()
