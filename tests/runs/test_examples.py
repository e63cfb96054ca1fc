"""The programs in examples/, each run through torchrun on 2 gloo processes. own_loop.py (its
own model, a TP plan then FSDP2, the checkpointer resuming across the two layouts) is checked
against itself on one process. The documents' programs, whose only change is their import
line (hfai_style.py, fsdp1_style.py, megatron_style.py, device_mesh_hsdp.py), are checked
against the same loop with no wrapper at all, run here in the test's process from the
example's own functions: losses to 1e-5 (fp32), trained weights to 1e-5 as their
checkpoints hold them, and each checkpoint loading as its document says."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import sys
from types import ModuleType

import torch

from tests.helpers.commands import LAUNCHER_ENV, Run, run_command
from tests.helpers.distributed import REPO, run_env
from tests.helpers.token_data import make_prepared

LOSS = re.compile(r"^(?:(\w+) )?step (\d+) loss (\S+)", re.MULTILINE)


def torchrun(script: str, *args: str) -> Run:
    return run_command(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            f"examples/{script}",
            *args,
        ],
        run_env(),
    )


def one_process(script: str, *args: str) -> Run:
    env = {k: v for k, v in run_env().items() if k not in LAUNCHER_ENV}
    return run_command([sys.executable, f"examples/{script}", *args], env)


def losses(run: Run, tag: str | None = None) -> dict[int, float]:
    """The printed losses by step (of the lines tagged `tag`, or the untagged ones)."""
    assert run.returncode == 0, run.describe()
    found = {int(step): float(loss) for name, step, loss in LOSS.findall(run.stdout) if (name or None) == tag}
    assert found, run.describe()
    return found


def assert_same_losses(got: dict[int, float], reference: dict[int, float]) -> None:
    assert got.keys() == reference.keys(), (got, reference)
    worst = max(abs(got[s] - reference[s]) / max(1.0, abs(reference[s])) for s in got)
    assert worst <= 1e-5, (got, reference)


def assert_same_weights(saved: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert saved.keys() == expected.keys()
    worst = max((saved[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, worst


def example(name: str) -> ModuleType:
    """An example's module, imported from its file (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_loop_trains_with_a_tp_plan_then_resumes_under_fsdp_like_one_process(tmp_path):
    data = str(make_prepared(tmp_path / "tokens", 16 * 200).folder)
    reference = losses(one_process("own_loop.py", "--data", data, "--steps", "6"))
    ckpt = str(tmp_path / "ckpt")
    first = losses(torchrun("own_loop.py", "--data", data, "--steps", "3", "--tp", "2", "--ckpt", ckpt))
    resumed = losses(torchrun("own_loop.py", "--data", data, "--steps", "6", "--ckpt", ckpt))
    assert sorted(resumed) == [4, 5, 6]  # resumed at step 3's checkpoint, saved at tp 2, loaded at FSDP 2
    assert_same_losses({**first, **resumed}, reference)


def test_hfai_code_trains_like_the_unwrapped_loop_and_both_of_its_checkpoints_load(tmp_path):
    run = torchrun("hfai_style.py", "--out", str(tmp_path))
    hfai = example("hfai_style")
    plain = hfai.build()
    reference = hfai.train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), hfai.STEPS, 0, 1)
    assert_same_losses(losses(run), reference)
    assert_same_weights(torch.load(tmp_path / "model.pt"), plain)  # the whole checkpoint, from summon_full_params
    pieces = [torch.load(tmp_path / f"model{rank}.pt") for rank in (0, 1)]  # each rank's own: half of each tensor
    assert all(pieces[0][k].shape[0] + pieces[1][k].shape[0] == v.shape[0] for k, v in plain.state_dict().items())
    match = re.search(
        r"unwrapped model differs by (\S+), rewrapped by (\S+); per-rank checkpoint: by (\S+)", run.stdout
    )
    assert match and all(float(diff) <= 1e-6 for diff in match.groups()), run.describe()


def test_fsdp1_code_trains_like_the_unwrapped_loop_and_resumes_from_its_optimizer_state_every_way(tmp_path):
    """Steps 1-3, a whole checkpoint (model + full_optim_state_dict), then steps 4-6 from it
    four ways: scattered, sharded by every rank, re-keyed into a plain optimizer, and through
    optim_state_dict_to_load from a sharded DCP checkpoint. Each continues the plain loop."""
    run = torchrun("fsdp1_style.py", "--out", str(tmp_path))
    fsdp1 = example("fsdp1_style")
    plain = fsdp1.build()
    torch.manual_seed(1)
    plain.apply(fsdp1.init_weights)
    optim = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(plain.parameters()))
    reference = fsdp1.train(plain, optim, range(1, fsdp1.RESUME_AT + 1), 0, 1, clip)
    assert_same_weights(torch.load(tmp_path / "checkpoint.pt")["model"], plain)
    assert_same_losses(losses(run, "train"), reference)
    reference = fsdp1.train(plain, optim, range(fsdp1.RESUME_AT + 1, fsdp1.STEPS + 1), 0, 1, clip)
    for resume in ("scatter", "shard", "plain", "sharded"):
        assert_same_losses(losses(run, resume), reference)
    assert re.search(r"FSDP modules: 7, roots: 1", run.stdout), (
        run.describe()
    )  # the v1.12 policy wraps each up/down Linear


def test_megatron_code_trains_like_the_unwrapped_loop_and_its_sharded_checkpoint_loads_anywhere(tmp_path):
    import torch.distributed.checkpoint as dcp

    run = torchrun("megatron_style.py", "--out", str(tmp_path))
    megatron = example("megatron_style")
    plain = megatron.build()
    reference = megatron.train(
        Unwrapped(plain), torch.optim.AdamW(plain.parameters(), lr=1e-2), range(1, megatron.STEPS + 1), 0, 1
    )
    assert_same_losses(losses(run), reference)
    saved = {k: torch.empty_like(v) for k, v in plain.state_dict().items()}
    dcp.load(saved, checkpoint_id=tmp_path / "checkpoint")  # the 2-rank shards, read by one process
    assert_same_weights(saved, plain)
    units = re.search(r"FSDP units: (.*)", run.stdout).group(1).split(", ")
    assert units == [
        "embedding",
        "decoder.layers.0",
        "decoder.layers.0.mlp",
        "decoder.layers.1",
        "decoder.layers.1.mlp",
    ]
    match = re.search(r"restored model differs by (\S+)", run.stdout)
    assert match and float(match.group(1)) <= 1e-6, run.describe()


class Unwrapped(torch.nn.Module):
    """A plain model with the Megatron wrapper's methods doing what they do on one process:
    nothing to synchronize."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)

    def no_sync(self):
        return contextlib.nullcontext()

    def zero_grad_buffer(self):
        self.module.zero_grad(set_to_none=True)

    def finish_grad_sync(self):
        pass


def test_the_device_mesh_hsdp_example_trains_like_the_unwrapped_loop():
    run = torchrun("device_mesh_hsdp.py")
    mesh = example("device_mesh_hsdp")
    assert_same_losses(losses(run), mesh.train(mesh.build(), mesh.STEPS, 0, 1))
    assert "mesh (1, 2): net1.weight holds 50 of 100 elements on rank 0" in run.stdout, run.describe()
