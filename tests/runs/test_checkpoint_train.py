"""Checkpointing through the real trainer (`python -m titanlite.train`, on several gloo processes
started as torchrun starts its workers, CPU), on the debug model, fp32, fixed seed, global batch 8:

- resume is bit-exact: 4 steps straight == 2 steps, stop, resume to 4 (losses compared
  with ==, and every model and optimizer tensor of the final checkpoints with torch.equal),
  on FSDP 2 x TP 2 and on FSDP 2 (the FSDP 2 runs start from a 1-process seed checkpoint);
- reshard: the FSDP 2 x TP 2 checkpoint resumes at FSDP 4 and on 1 process, matching the
  uninterrupted run within 1e-5 relative;
- kill -9 of a rank during an async save (under the launcher): the restart ignores the
  half-written folder and resumes from the previous complete step;
- initial loads from a DCP folder and from a Hugging Face export give the same model;
- bad input is one line naming the path, exit code 2, never a silent fresh start.

Losses come from the TensorBoard event files the trainer writes under dump_folder/tb.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.distributed import REPO, run_env, run_mains, run_ranks, with_overrides
from titanlite.checkpoint import export

TRAIN_ENTRY = ["-m", "titanlite.train"]
# The runs train STEPS steps, saving every STOP; a stopped run stops at STOP and resumes to STEPS.
STOP, STEPS = 2, 4
BASE = [
    "--config",
    "debug_model",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    # Constant lr after warmup: a run told to stop at step 2 follows the same schedule as
    # one told to run 4 steps, so "2 steps, stop, resume to 4" is comparable with "4".
    "--lr_scheduler.decay_ratio",
    "0",
    "--metrics.log_freq",
    "1",
    "--metrics.peak_flops",
    "1e11",  # skip the start-up matmul measurement
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    str(STOP),
    "--checkpoint.async_mode",
    "async",
    "--checkpoint.keep_latest_k",
    "0",
]
# name: (processes, overrides); local batch x dp = 8 everywhere, no accumulation.
LAYOUTS = {
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "fsdp4": (4, ["--training.local_batch_size", "2"]),
    "single": (1, ["--training.local_batch_size", "8"]),
}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = run_env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even on a GPU machine: several ranks, one GPU
    env.update(extra or {})
    return env


def _launcher_command(nproc: int, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "titanlite.launch", "--standalone", f"--nproc-per-node={nproc}", *TRAIN_ENTRY, *argv]


def train(
    layout: str, dump: Path, *args: str, timeout: float = 180, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    nproc, overrides = LAYOUTS[layout]
    argv = with_overrides(BASE, overrides, args, ["--job.dump_folder", str(dump)])
    result = run_ranks(nproc, TRAIN_ENTRY, argv, timeout, env=_env(env))
    if check and result.returncode != 0:
        raise AssertionError(f"trainer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def losses(dump: Path) -> dict[int, float]:
    """step -> loss over every run (each start writes its own event folder) in dump/tb."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[int, float] = {}
    for run in sorted({p.parent for p in (dump / "tb").rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(run))
        accumulator.Reload()
        if "loss" in accumulator.Tags()["scalars"]:
            merged.update({e.step: e.value for e in accumulator.Scalars("loss")})
    return merged


def ckpt(dump: Path, step: int) -> Path:
    return dump / "checkpoint" / f"step-{step}"


def assert_checkpoints_equal(a: Path, b: Path) -> None:
    """Every model and optimizer tensor, full (unsharded), bit for bit."""
    left, right = export.read_dcp_tensors(a), export.read_dcp_tensors(b)
    assert left.keys() == right.keys()
    assert any(k.startswith("optimizer.") for k in left) and any(k.startswith("model.") for k in left)
    import torch

    different = [k for k in left if not torch.equal(left[k], right[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def copy_checkpoint(source: Path, dump: Path) -> None:
    shutil.copytree(source, dump / "checkpoint" / source.name)


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """A 1-process seed checkpoint (step 0, weights only) for the FSDP 2 runs."""
    dump = tmp_path_factory.mktemp("seed")
    result = train("single", dump, "--checkpoint.create_seed_checkpoint", "true")
    assert (ckpt(dump, 0) / "commit.json").is_file(), result.stdout
    return ckpt(dump, 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed) -> dict[str, dict[str, Path]]:
    """Per layout: an uninterrupted STEPS-step run, and a run stopped at STOP then resumed to STEPS
    (which also writes its last step as a Hugging Face folder)."""
    out = {}
    for layout in ("fsdp2_tp2", "fsdp2"):
        straight, resumed = tmp_path_factory.mktemp(f"{layout}-straight"), tmp_path_factory.mktemp(f"{layout}-resumed")
        if layout == "fsdp2":
            copy_checkpoint(seed, straight)
            copy_checkpoint(seed, resumed)
        logs = {
            "straight": train(layout, straight, "--training.steps", str(STEPS)).stdout,
            "stop": train(layout, resumed, "--training.steps", str(STOP)).stdout,
            "resume": train(
                layout, resumed, "--training.steps", str(STEPS), "--checkpoint.last_save_in_hf", "true"
            ).stdout,
        }
        out[layout] = {"straight": straight, "resumed": resumed, "logs": logs}
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["fsdp2_tp2", "fsdp2"])
def test_resume_is_bit_exact(runs, layout):
    run = runs[layout]
    assert f"resumed from {ckpt(run['resumed'], STOP)} at step {STOP}" in run["logs"]["resume"]
    straight, resumed = losses(run["straight"]), losses(run["resumed"])
    assert sorted(straight) == sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == straight  # exact float equality, every step
    assert_checkpoints_equal(ckpt(run["straight"], STEPS), ckpt(run["resumed"], STEPS))


def test_seed_checkpoint_initializes_multi_process_runs(runs, seed):
    record = json.loads((seed / "commit.json").read_text())
    assert record["model_weights_only"] and record["world_size"] == 1 and record["contents"] == ["model"]
    for log in (runs["fsdp2"]["logs"]["straight"], runs["fsdp2"]["logs"]["stop"]):
        assert "initialized the model from the seed checkpoint" in log
    # The seed holds what a fresh init gives, so the FSDP 2 runs match the FSDP 2 x TP 2 ones.
    assert losses(runs["fsdp2"]["straight"])[1] == pytest.approx(losses(runs["fsdp2_tp2"]["straight"])[1], rel=1e-5)


@pytest.mark.timeout(120)
def test_seed_checkpoint_with_the_default_compute_dtype(tmp_path):
    """`mixed_precision_param` "auto" (the default) is decided for the seed as for training,
    not left to the model build (which refuses "auto"); the weights are saved in float32."""
    import torch

    result = train(
        "single", tmp_path, "--checkpoint.create_seed_checkpoint", "true", "--training.mixed_precision_param", "auto"
    )
    assert "compute dtype " in result.stdout and "(auto: " in result.stdout, result.stdout[-2000:]
    record = json.loads((ckpt(tmp_path, 0) / "commit.json").read_text())
    assert record["model_weights_only"] and record["contents"] == ["model"]
    weights = export.read_dcp_model(ckpt(tmp_path, 0))
    assert weights and {tensor.dtype for tensor in weights.values()} == {torch.float32}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["fsdp4", "single"])
def test_reshard_on_resume(runs, layout, tmp_path):
    """The FSDP 2 x TP 2 step-2 checkpoint resumes at another mesh; DCP reshards."""
    reference = runs["fsdp2_tp2"]
    copy_checkpoint(ckpt(reference["resumed"], STOP), tmp_path)
    result = train(layout, tmp_path, "--training.steps", str(STEPS))
    assert "saved at world size 4 (mesh dp_shard 2 x tp 2)" in result.stdout
    expected, got = losses(reference["straight"]), losses(tmp_path)
    assert sorted(got) == list(range(STOP + 1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), f"step {step}"


def _rank_pid(run_id: str, rank: int) -> int | None:
    """The trainer process of `rank` in the run tagged with `run_id` (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (
            f"TITANLITE_TEST_RUN_ID={run_id}".encode() in environ
            and f"RANK={rank}".encode() in environ
            and b"launch" not in cmdline
        ):
            return int(entry.name)
    return None


@pytest.mark.timeout(300)
def test_kill_during_async_save_resumes_from_previous_complete_step(tmp_path):
    run_id = uuid.uuid4().hex
    nproc, overrides = LAYOUTS["fsdp2"]
    argv = with_overrides(
        BASE, overrides, ["--training.steps", "6", "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path)]
    )
    # Every rank's writer pauses 4 s after writing its shards: a save stays in flight.
    env = _env({"TITANLITE_TEST_SLOW_WRITE_S": "4", "TITANLITE_TEST_RUN_ID": run_id})
    process = subprocess.Popen(
        _launcher_command(nproc, argv), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed = None
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if (ckpt(tmp_path, 2) / "commit.json").is_file() and list(ckpt(tmp_path, 4).glob("*.distcp")):
                killed = _rank_pid(run_id, 1)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
                    break
            time.sleep(0.05)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert killed is not None, f"the step-4 save was never caught in flight\n{output[-3000:]}"
    assert process.returncode != 0
    assert not (ckpt(tmp_path, 4) / "commit.json").exists()

    restart = train("fsdp2", tmp_path, "--training.steps", "6", "--checkpoint.interval", "2")
    assert f"ignoring incomplete checkpoint folder(s) step-4 under {tmp_path / 'checkpoint'}" in restart.stdout
    assert f"resumed from {ckpt(tmp_path, 2)} at step 2" in restart.stdout
    assert all((ckpt(tmp_path, s) / "commit.json").is_file() for s in (2, 4, 6))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["fsdp2_tp2", "fsdp2"])
def test_last_save_in_hf_loads_in_transformers_with_equal_logits(runs, layout):
    """`checkpoint.last_save_in_hf`: the ranks' Hugging Face folder of the last step, with
    the run's tokenizer, is the model of the last DCP checkpoint to transformers."""
    transformers = pytest.importorskip("transformers")
    import torch

    from titanlite.checkpoint import commit
    from titanlite.models.llama import llama3_hf as hf_adapter
    from titanlite.models.llama.model import Llama

    run = runs[layout]["resumed"]
    hf = run / "checkpoint" / f"step-{STEPS}-hf"
    assert f"step {STEPS} written as a Hugging Face folder {hf}" in runs[layout]["logs"]["resume"]
    tokenizer = Path(commit.read_commit(ckpt(run, STEPS)).tokenizer["path"]).name
    assert (hf / tokenizer).is_file() and (hf / "model.safetensors.index.json").is_file()
    assert commit.scan(run / "checkpoint").complete[-1] == STEPS  # the HF folder is no checkpoint step
    args = hf_adapter.args_from_hf_config(json.loads((hf / "config.json").read_text()))
    ours = Llama(args)
    ours.init_weights(seed=0)  # the RoPE table; the weights come next
    ours.load_state_dict(export.read_dcp_model(ckpt(run, STEPS)))
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


def run_cases(cases: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    """Several 1-process runs of the real entry point `titanlite.train.main`, in one
    interpreter to pay the imports once. Returns name -> (exit code, its stderr)."""
    nproc, overrides = LAYOUTS["single"]
    runs = run_mains(
        "titanlite.train", [with_overrides(BASE, overrides, argv) for argv in cases.values()], 240, env=_env()
    )
    return {name: (run.returncode, run.stderr) for name, run in zip(cases, runs)}


@pytest.mark.timeout(300)
def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    source = ckpt(runs["fsdp2_tp2"]["resumed"], STOP)
    names = ("missing", "nostep", "corrupt", "truncated", "flavor", "initial", "groups", "optimizer")
    dumps = {name: tmp_path / name for name in names}
    for name in ("nostep", "corrupt", "truncated", "flavor", "groups", "optimizer"):
        copy_checkpoint(source, dumps[name])
    shard = sorted(ckpt(dumps["corrupt"], STOP).glob("*.distcp"))[1]
    shard.write_bytes(os.urandom(shard.stat().st_size))
    truncated = sorted(ckpt(dumps["truncated"], STOP).glob("*.distcp"))[2]
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    commit = ckpt(dumps["flavor"], STOP) / "commit.json"
    record = json.loads(commit.read_text())
    record["fingerprint"].update(flavor="8B", args=record["fingerprint"]["args"].replace("dim=256", "dim=4096"))
    commit.write_text(json.dumps(record))
    cases = {
        "missing": ["--checkpoint.load_step", "3"],
        "nostep": ["--checkpoint.load_step", "7"],
        "corrupt": [],
        "truncated": [],
        "flavor": [],
        "initial": ["--checkpoint.initial_load_path", str(tmp_path / "no-such-dir")],
        "groups": ["--optimizer.param_groups", '["*norm.weight: weight_decay=0"]'],
        "optimizer": ["--optimizer.name", "Muon"],
    }
    expected = {
        "missing": "checkpoint.load_step: 3 was asked for, but the checkpoint folder "
        f"{dumps['missing'] / 'checkpoint'} does not exist",
        "nostep": f"checkpoint.load_step: {ckpt(dumps['nostep'], 7)} does not exist; complete steps: {STOP}",
        "corrupt": f"{shard}: shard file is corrupted (CRC-32 ",
        "truncated": f"{truncated}: shard is truncated",
        "flavor": f"{ckpt(dumps['flavor'], STOP)}: checkpoint is of model llama3 flavor 8B",
        "initial": f"checkpoint.initial_load_path: {tmp_path / 'no-such-dir'} does not exist",
        "groups": f"{ckpt(dumps['groups'], STOP)}: parameter layers.0.attention_norm.weight was saved in "
        "optimizer group "
        "'tok_embeddings.* *norm.weight: lr_scale=1 weight_decay=0', this run puts it in "
        "'*norm.weight: lr_scale=1 weight_decay=0'",
        "optimizer": f"{ckpt(dumps['optimizer'], STOP)}: the checkpoint has no optimizer.param_groups.",
    }
    results = run_cases(
        {name: [*argv, "--training.steps", "6", "--job.dump_folder", str(dumps[name])] for name, argv in cases.items()}
    )
    for name, (rc, stderr) in results.items():
        lines = [line for line in stderr.splitlines() if line.startswith("titanlite: error:")]
        assert rc == 2, f"{name}: exit {rc}\n{stderr[-2000:]}"
        assert len(lines) == 1 and expected[name] in lines[0], f"{name}: {lines or stderr[-2000:]}"
        assert not (dumps[name] / "tb").exists() or not losses(dumps[name]), f"{name}: trained anyway"

    # And once as a process, through `python -m titanlite.train`: the exit code itself.
    result = train("single", tmp_path / "again", "--checkpoint.load_step", "3", check=False)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr[-2000:]


def broken_hf_copies(hf: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Four Hugging Face folders a user can get wrong, each with the line that names it:
    a shard the index names is missing, a tensor has the wrong shape, config.json is of
    another model family, a stray safetensors file the index does not name (DCP's reader
    would load its tensors over the indexed ones)."""
    import safetensors.torch as st
    import torch

    broken = {name: tmp_path / f"hf-{name}" for name in ("shard", "shape", "family", "stray")}
    for folder in broken.values():
        shutil.copytree(hf, folder)
    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    gone = broken["shard"] / weight_map["model.layers.0.self_attn.q_proj.weight"]
    gone.unlink()
    norm_file = broken["shape"] / weight_map["model.norm.weight"]
    tensors = st.load_file(str(norm_file))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    st.save_file(tensors, str(norm_file), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    (broken["family"] / "config.json").write_text(
        json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    dim = config["hidden_size"]
    stray = broken["stray"] / "extra.safetensors"
    st.save_file({"model.norm.weight": torch.full((dim,), 5.0)}, str(stray), metadata={"format": "pt"})
    return {
        "stray": (broken["stray"], f"{stray}: model.safetensors.index.json does not name this file"),
        "shard": (broken["shard"], f"{gone}: missing, but model.safetensors.index.json names it"),
        "shape": (
            broken["shape"],
            f"{norm_file}: tensor model.norm.weight has shape [{dim - 1}], this model's norm.weight is [{dim}]",
        ),
        "family": (
            broken["family"],
            f"{broken['family'] / 'config.json'}: describes another model: model_type 'gpt2' (this model: 'llama')",
        ),
    }


@pytest.mark.timeout(300)
def test_initial_load_from_dcp_and_from_hugging_face(runs, tmp_path):
    """The same weights as a DCP folder and as a Hugging Face folder in several files give
    the same first loss; broken Hugging Face folders are one line each and exit 2."""
    pytest.importorskip("safetensors")
    from tests.helpers.scripts import script_main

    source = ckpt(runs["fsdp2_tp2"]["resumed"], STOP)
    convert = script_main("convert_hf.py")
    assert convert(["to-hf", str(source), str(tmp_path / "hf"), "--max-shard-size", "400KB"]) == 0
    assert (
        len(set(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    )
    broken = broken_hf_copies(tmp_path / "hf", tmp_path)
    hf = ["--checkpoint.initial_load_format", "hf"]
    cases = {
        "dcp": ["--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_format", "dcp"],
        "hf": ["--checkpoint.initial_load_path", str(tmp_path / "hf"), *hf],
    }
    cases.update(
        {f"hf-{name}": ["--checkpoint.initial_load_path", str(folder), *hf] for name, (folder, _) in broken.items()}
    )
    results = run_cases(
        {
            name: [*argv, "--training.steps", "1", "--job.dump_folder", str(tmp_path / name)]
            for name, argv in cases.items()
        }
    )
    assert results["dcp"][0] == 0 and results["hf"][0] == 0, results
    first = {name: losses(tmp_path / name)[1] for name in ("dcp", "hf")}
    fresh = losses(runs["fsdp2_tp2"]["straight"])[1]
    assert first["dcp"] != pytest.approx(fresh, rel=1e-3)  # trained weights, not the init
    assert first["hf"] == first["dcp"]
    for name, (_, expected) in broken.items():
        rc, stderr = results[f"hf-{name}"]
        lines = [line for line in stderr.splitlines() if line.startswith("titanlite: error:")]
        assert rc == 2 and len(lines) == 1 and expected in lines[0], f"{name}: exit {rc}: {lines or stderr[-2000:]}"
