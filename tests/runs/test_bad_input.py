"""Every malformed input a user can give ends the same way: exit code 2, exactly one short
`titanlite: error:` line on stderr naming what is wrong, no traceback, no process left.

A table of cases: wrong types, zero and negative degrees, unknown keys and sections,
impossible meshes and pipeline or context-parallel layouts, options a model does not declare
(GPT-2: context parallelism, Hugging Face loads and saves), bad paths, TOML files that are
broken, empty or folders, bad dtypes and enum values, overrides without values or given
twice, and the run's files: a dump folder
under a file, a locked dump folder, too little disk for one checkpoint, a truncated or a
corrupted checkpoint shard, a prepared data shard corrupted inside the vocabulary (with
training.verify_data), another tokenizer than the checkpoint's, a Hugging Face
config.json of another model, a last-step save that cannot be written. Most cases run as
`python -m titanlite.train` on one plain process (it validates the same config as every
rank does), two at a time; a handful run through the launcher with 2 processes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.commands import LAUNCHER_ENV, Run, run_command
from tests.helpers.distributed import REPO, mains_command, run_env, split_mains
from tests.helpers.token_data import SHIPPED, change_a_token_inside_the_vocabulary, make_prepared

SMALL_RUN = {
    "training.steps": "1",
    "training.seq_len": "64",
    "training.local_batch_size": "2",
    "metrics.enable_tensorboard": "false",
    "metrics.peak_flops": "1e11",  # no start-up matmul measurement
}
CHECKPOINTING = {"checkpoint.enable_checkpoint": "true", "checkpoint.async_mode": "disabled"}
TP = "parallelism.tensor_parallel_degree"
PP = "parallelism.pipeline_parallel_degree"
CP = "parallelism.context_parallel_degree"
EP = "parallelism.expert_parallel_degree"
MOE = {"model.name": "qwen3", "model.flavor": "debugmodel_moe"}
# The longest error line a case may print, paths (pytest's temporary folders) included: a
# line that lists every valid value or quotes a pasted value whole stops reading as one line.
MAX_ERROR_LINE = 300
DUMP = "{dump}"  # placeholders, filled per case
CASE = "{case}"
PLAIN_TIMEOUT_S = 600  # every plain case, one after another in one interpreter


@dataclass(frozen=True)
class Case:
    """One mistake: overrides merged over SMALL_RUN, raw words appended after them, and the
    texts the error line must contain. `prepare(case_dir, checkpoint)` makes the files a
    case needs (a broken TOML, a corrupted shard, a held lock) and may return a cleanup."""

    mentions: list[str]
    overrides: dict[str, str] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)
    config: str | None = "debug_model"
    prepare: Callable[[Path, Path], Callable[[], None] | None] | None = None
    nproc: int = 1
    shell_prefix: str = ""  # run through `bash -c` with this before exec (e.g. a ulimit)
    # A plain process told it is rank 0 of this many (as torchrun would): the layout checks
    # refuse it before any rendezvous, so the other ranks are never needed.
    world_size: int = 1


# ---------------------------------------------------------------- what the cases prepare


def write(relative: str, content: str | bytes) -> Callable[[Path, Path], None]:
    def prepare(case: Path, _checkpoint: Path) -> None:
        path = case / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())

    return prepare


def folder(relative: str) -> Callable[[Path, Path], None]:
    def prepare(case: Path, _checkpoint: Path) -> None:
        (case / relative).mkdir(parents=True, exist_ok=True)

    return prepare


def shards(case: Path) -> list[Path]:
    return sorted((case / "out" / "checkpoint").glob("step-*/*.distcp"))


def with_checkpoint(damage: Callable[[Path], None] | None = None) -> Callable[[Path, Path], None]:
    """A copy of the module's 2-process checkpoint in this case's dump folder, then `damage`."""

    def prepare(case: Path, checkpoint: Path) -> None:
        shutil.copytree(checkpoint, case / "out" / "checkpoint")
        if damage is not None:
            damage(case)

    return prepare


def truncate_first_shard(case: Path) -> None:
    shard = shards(case)[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def flip_bytes_in_last_shard(case: Path) -> None:
    """Inside the tensor data, not the header: DCP alone would load this without a word."""
    shard = shards(case)[-1]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        data = f.read(8)
        f.seek(-8, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def dataset_corrupted_inside_the_vocabulary(case: Path, _checkpoint: Path) -> None:
    """One shard of the shipped tokenizer's ids, one of them changed to another valid id:
    without training.verify_data this trains silently."""
    from titanlite.data import Tokenizer

    make_prepared(case / "data", 65 * 40, sha256=Tokenizer(str(SHIPPED)).sha256, shard_tokens=65 * 40)
    change_a_token_inside_the_vocabulary(case / "data" / "shard-00000.bin", 100)


def another_tokenizer_in_the_record(case: Path) -> None:
    marker = next((case / "out" / "checkpoint").glob("step-*/commit.json"))
    record = json.loads(marker.read_text())
    record["tokenizer"].update(path="/elsewhere/other.model", crc32="0badf00d")
    marker.write_text(json.dumps(record))


def hold_the_lock(case: Path, _checkpoint: Path) -> Callable[[], None]:
    from titanlite.runtime.dump_folder import acquire_lock

    (case / "out").mkdir(parents=True)
    return acquire_lock(case / "out").release  # held by this test process, a live job


def hf_config_of_another_theta(case: Path, _checkpoint: Path) -> None:
    from titanlite.data import Tokenizer
    from titanlite.models import get_model_spec
    from titanlite.models.llama import llama3_hf as hf_adapter

    args = get_model_spec("llama3", "debugmodel").args_for(
        "debugmodel", Tokenizer(str(REPO / "assets/tokenizer/titanlite.model")).vocab_size
    )
    config = {
        **hf_adapter.hf_config(args),
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    write("hf/config.json", json.dumps(config))(case, _checkpoint)


# ---------------------------------------------------------------- the table

CASES: dict[str, Case] = {
    # wrong types
    "string_for_int": Case(["training.steps", "abc"], {"training.steps": "abc"}),
    "float_for_int": Case(["training.local_batch_size", "1.5"], {"training.local_batch_size": "1.5"}),
    "bad_boolean": Case(["training.deterministic", "maybe"], {"training.deterministic": "maybe"}),
    "nan_float": Case(["optimizer.lr", "finite"], {"optimizer.lr": "nan"}),
    "broken_list": Case(["parallelism.fsdp_shard_modules"], {"parallelism.fsdp_shard_modules": '["Block",'}),
    "pasted_text_for_int": Case(["training.steps", "(2,002 characters)"], {"training.steps": "x" * 2000}),
    "torchtitan_list_option_as_one_name": Case(
        ["model.converters: mx is not supported: MXFP8 needs an SM100 GPU"], extra=["--model.converters", "mx"]
    ),
    # LoRA: a target no linear has (the model's linears listed), rank 0, an export the model has no HF names for
    "lora_target_matching_no_linear": Case(
        ["lora.target_modules: ['q_proj'] match no linear layer", "wq"],
        extra=["--model.converters", "lora", "--lora.target_modules", "q_proj"],
    ),
    "lora_rank_zero": Case(["lora.rank", "0"], extra=["--model.converters", "lora", "--lora.rank", "0"]),
    "lora_export_of_a_model_without_hf_names": Case(
        ["checkpoint.last_save_in_hf", "gpt2"],
        {"model.name": "gpt2", "checkpoint.last_save_in_hf": "true"},
        extra=["--model.converters", "lora", "--lora.target_modules", "c_attn"],
    ),
    # zero, negative and out-of-range values
    "steps_zero": Case(["training.steps", "0"], {"training.steps": "0"}),
    "steps_negative": Case(["training.steps", "-3"], {"training.steps": "-3"}),
    "steps_that_cannot_finish": Case(["training.steps", "1e+09", str(10**20)], {"training.steps": str(10**20)}),
    "tp_degree_zero": Case([TP, "0"], {TP: "0"}),
    "tp_degree_negative": Case([TP, "-2"], {TP: "-2"}),
    "dp_shard_degree_zero": Case(
        ["parallelism.data_parallel_shard_degree", "0"], {"parallelism.data_parallel_shard_degree": "0"}
    ),
    "seq_len_over_the_flavor": Case(["training.seq_len", "max_seq_len"], {"training.seq_len": "4096"}),
    "global_batch_not_a_multiple": Case(["training.global_batch_size"], {"training.global_batch_size": "3"}),
    # impossible meshes on one process
    "tp_larger_than_the_world": Case(["world size 1", "tensor_parallel_degree 2"], {TP: "2"}),
    "dp_shard_larger_than_the_world": Case(
        ["data_parallel_shard_degree 4", "world size is 1"], {"parallelism.data_parallel_shard_degree": "4"}
    ),
    # unknown names
    "unknown_key": Case(["training.stepz", "training.steps"], extra=["--training.stepz", "3"]),
    "unknown_section": Case(["trainer.steps", "training.steps"], extra=["--trainer.steps", "3"]),
    "key_without_section": Case(["steps", "training.steps"], extra=["--steps", "3"]),
    # the command line's shape
    "override_without_value_at_the_end": Case(["training.max_norm", "needs a value"], extra=["--training.max_norm"]),
    "override_without_value_before_an_option": Case(
        ["optimizer.lr", "needs a value"], extra=["--optimizer.lr", "--optimizer.eps", "1e-8"]
    ),
    "override_given_twice": Case(["--training.steps given twice (1 and 8)"], extra=["--training.steps", "8"]),
    "config_given_twice": Case(["--config given twice"], extra=["--config", "debug_model"]),
    "config_without_value": Case(["--config needs a value"], config=None, extra=["--config"]),
    "stray_word": Case(["'oops'"], extra=["oops"]),
    # TOML files
    "toml_syntax_error": Case(
        ["invalid TOML", "bad.toml"], config=f"{CASE}/bad.toml", prepare=write("bad.toml", "[training]\nsteps = = 3\n")
    ),
    "toml_empty": Case(["empty.toml", "is empty"], config=f"{CASE}/empty.toml", prepare=write("empty.toml", "")),
    "toml_unknown_section": Case(
        ["[trainer]", "[training]"], config=f"{CASE}/c.toml", prepare=write("c.toml", "[trainer]\nsteps = 3\n")
    ),
    "toml_unknown_key": Case(
        ["training.stepz"], config=f"{CASE}/c.toml", prepare=write("c.toml", "[training]\nstepz = 3\n")
    ),
    "toml_wrong_type": Case(
        ["training.steps", "'ten'"], config=f"{CASE}/c.toml", prepare=write("c.toml", '[training]\nsteps = "ten"\n')
    ),
    "toml_key_outside_a_section": Case(
        ["steps", "[section]"], config=f"{CASE}/c.toml", prepare=write("c.toml", "steps = 3\n")
    ),
    "config_is_a_folder": Case(["--config", "is a folder"], config=f"{CASE}/conf.toml", prepare=folder("conf.toml")),
    # bad dtypes and enum values
    "dtype_float64": Case(["training.mixed_precision_param", "float64"], {"training.mixed_precision_param": "float64"}),
    "async_mode_unknown": Case(["checkpoint.async_mode", "sometimes"], {"checkpoint.async_mode": "sometimes"}),
    "ac_mode_unknown": Case(["activation_checkpoint.mode", "partial"], {"activation_checkpoint.mode": "partial"}),
    "model_unknown": Case(["model.name", "gpt5"], {"model.name": "gpt5"}),
    "flavor_unknown": Case(["model.flavor", "1T"], {"model.flavor": "1T"}),
    # paths
    "tokenizer_is_a_folder": Case(
        ["model.tokenizer_path", f"{CASE}/tok"], {"model.tokenizer_path": f"{CASE}/tok"}, prepare=folder("tok")
    ),
    "dataset_path_missing": Case(
        ["training.dataset_path", f"{CASE}/none.txt"],
        {"training.dataset": "files", "training.dataset_path": f"{CASE}/none.txt"},
    ),
    "dataset_files_without_a_path": Case(["training.dataset_path"], {"training.dataset": "files"}),
    "dataset_shard_corrupted_inside_the_vocabulary": Case(
        ["training.dataset_path", f"{CASE}/data/shard-00000.bin is corrupted: CRC-32"],
        {"training.dataset": "prepared", "training.dataset_path": f"{CASE}/data", "training.verify_data": "true"},
        prepare=dataset_corrupted_inside_the_vocabulary,
    ),
    "initial_load_path_missing": Case(
        ["checkpoint.initial_load_path", f"{CASE}/none"], {"checkpoint.initial_load_path": f"{CASE}/none"}
    ),
    "load_step_that_does_not_exist": Case(["checkpoint.load_step: 3"], {**CHECKPOINTING, "checkpoint.load_step": "3"}),
    "hf_config_of_another_model": Case(
        [f"{CASE}/hf/config.json", "rope_theta 10000.0 (this model: 500000.0)"],
        {"checkpoint.initial_load_path": f"{CASE}/hf", "checkpoint.initial_load_format": "hf"},
        prepare=hf_config_of_another_theta,
    ),
    # the run's folders
    "dump_folder_under_a_file": Case(
        ["job.dump_folder", f"{CASE}/file is a file"],
        {"job.dump_folder": f"{CASE}/file/out"},
        prepare=write("file", "x"),
    ),
    "checkpoint_folder_is_a_file": Case(
        ["checkpoint.folder", f"{DUMP}/ckpt is a file"],
        {**CHECKPOINTING, "checkpoint.folder": "ckpt"},
        prepare=write("out/ckpt", "x"),
    ),
    "traces_folder_is_a_file": Case(
        ["profiling.save_traces_folder", f"{DUMP}/profile_traces is a file"],
        {"profiling.enable_profiling": "true"},
        prepare=write("out/profile_traces", "x"),
    ),
    "memory_snapshot_folder_is_a_file": Case(
        ["profiling.save_memory_snapshot_folder", f"{DUMP}/snapshots is a file"],
        {"profiling.enable_memory_snapshot": "true", "profiling.save_memory_snapshot_folder": "snapshots"},
        prepare=write("out/snapshots", "x"),
    ),
    "tensorboard_folder_under_a_file": Case(
        ["metrics.save_tb_folder", f"{DUMP}/tb is a file"],
        {"metrics.enable_tensorboard": "true"},
        prepare=write("out/tb", "x"),
    ),
    "runs_folder_is_a_file": Case(
        ["metrics.save_runs_folder", f"{DUMP}/runs is a file"], prepare=write("out/runs", "x")
    ),
    "dump_folder_locked": Case(
        ["job.dump_folder", "in use by another run", f"host {socket.gethostname()}, pid {os.getpid()}"],
        prepare=hold_the_lock,
    ),
    "disk_below_one_checkpoint": Case(
        ["checkpoint.folder", "GiB free", "one checkpoint of"], {**CHECKPOINTING, "model.flavor": "405B"}
    ),
    # checkpoints
    "shard_truncated": Case(
        ["__0_0.distcp: shard is truncated"], CHECKPOINTING, prepare=with_checkpoint(truncate_first_shard)
    ),
    "shard_corrupted_inside_its_data": Case(
        ["__1_0.distcp: shard file is corrupted"], CHECKPOINTING, prepare=with_checkpoint(flip_bytes_in_last_shard)
    ),
    "checkpoint_of_another_tokenizer": Case(
        ["model.tokenizer_path", "is not the tokenizer", "/elsewhere/other.model"],
        CHECKPOINTING,
        prepare=with_checkpoint(another_tokenizer_in_the_record),
    ),
    # A 1 MiB file-size limit: the shard write fails (EFBIG) inside DCP's blocking save.
    "last_step_save_cannot_be_written": Case(
        ["checkpoint: saving", "step-1 failed"], CHECKPOINTING, shell_prefix="ulimit -f 1024"
    ),
    # pipeline and context parallelism, refused before a device is touched
    "pp_does_not_divide_the_world": Case(["world size 1", "pipeline_parallel_degree 2"], {PP: "2"}),
    "pp_more_stages_than_blocks": Case([PP, "9 stages for a model of 6 blocks"], {PP: "9"}, world_size=9),
    "pp_too_few_microbatches": Case(
        ["parallelism.pipeline_parallel_microbatch_size", "1F1B needs at least one microbatch per stage (2)"],
        {PP: "2", "training.local_batch_size": "1"},
        world_size=2,
    ),
    "pp_microbatch_size_does_not_divide": Case(
        ["parallelism.pipeline_parallel_microbatch_size: 3 does not divide training.local_batch_size 2"],
        {PP: "2", "parallelism.pipeline_parallel_microbatch_size": "3"},
        world_size=2,
    ),
    "pp_v_schedule_without_two_stages_per_rank": Case(
        ["parallelism.pipeline_parallel_schedule", "ZBVZeroBubble runs exactly 2 stages per rank"],
        {
            PP: "2",
            "parallelism.pipeline_parallel_schedule": "ZBVZeroBubble",
            "parallelism.pipeline_parallel_layers_per_stage": "1",
        },
        world_size=2,
    ),
    "pp_single_stage_schedule_with_several": Case(
        ["parallelism.pipeline_parallel_schedule", "1F1B runs exactly 1 stage per rank"],
        {PP: "2", "parallelism.pipeline_parallel_split_points": "layers.2,layers.4,layers.5"},
        world_size=2,
    ),
    "pp_split_points_and_layers_per_stage": Case(
        ["parallelism.pipeline_parallel_split_points", "not both"],
        {
            PP: "2",
            "parallelism.pipeline_parallel_split_points": "layers.3",
            "parallelism.pipeline_parallel_layers_per_stage": "2",
        },
        world_size=2,
    ),
    "pp_split_point_not_a_block": Case(
        ["parallelism.pipeline_parallel_split_points", "'layers.9'"],
        {PP: "2", "parallelism.pipeline_parallel_split_points": "layers.9"},
        world_size=2,
    ),
    "pp_tied_embeddings": Case(
        [PP, "debugmodel_tied", "tok_embeddings and output"], {PP: "2", "model.flavor": "debugmodel_tied"}, world_size=2
    ),
    "cp_seq_len_not_divisible": Case(
        [CP, "training.seq_len 66", "2 x context_parallel_degree = 4"],
        {CP: "2", "training.seq_len": "66"},
        world_size=2,
    ),
    # expert parallelism borrows dp_shard x cp ranks and splits each MoE layer's experts
    "ep_does_not_divide_dp_shard_x_cp": Case(
        [EP, "3 does not divide data_parallel_shard_degree 4 x context_parallel_degree 1 = 4"],
        {**MOE, EP: "3"},
        world_size=4,
    ),
    "ep_does_not_divide_the_experts": Case(
        [EP, "3 does not divide model qwen3 flavor debugmodel_moe's 8 experts"], {**MOE, EP: "3"}, world_size=3
    ),
    "ep_on_a_dense_model": Case(
        [EP, "2 needs a model with MoE layers", "model llama3 flavor debugmodel has none"], {EP: "2"}, world_size=2
    ),
    # what a registered model does not declare (ModelSpec.capabilities), refused when the run is planned
    "cp_model_without_context_parallel_attention": Case(
        [CP, "model gpt2 has no context-parallel attention"], {CP: "2", "model.name": "gpt2"}, world_size=2
    ),
    "hf_load_of_a_model_without_hf_mapping": Case(
        ["checkpoint.initial_load_format", "model gpt2 has no Hugging Face mapping"],
        {"model.name": "gpt2", "checkpoint.initial_load_format": "hf", "checkpoint.initial_load_path": f"{CASE}/hf"},
        prepare=folder("hf"),
    ),
    "hf_save_of_a_model_without_hf_mapping": Case(
        ["checkpoint.last_save_in_hf", "model gpt2 has no Hugging Face mapping"],
        {**CHECKPOINTING, "model.name": "gpt2", "checkpoint.last_save_in_hf": "true"},
    ),
    "mask_type_unknown": Case(["model.attn_mask_type", "sliding"], {"model.attn_mask_type": "sliding"}),
    "param_groups_key_twice": Case(["lr_scale twice"], {"optimizer.param_groups": '["norm.*: lr_scale=1 lr_scale=2"]'}),
    "param_groups_typo": Case(["'nothing.*', which matches"], {"optimizer.param_groups": '["nothing.*: lr_scale=1"]'}),
    # through the launcher, 2 processes: every rank meets it, rank 0 alone says it
    "launcher_pp_too_few_microbatches": Case(
        ["1F1B needs at least one microbatch per stage"], {PP: "2", "training.local_batch_size": "1"}, nproc=2
    ),
    "launcher_tp_does_not_divide_the_world": Case(["world size 2", "tensor_parallel_degree 3"], {TP: "3"}, nproc=2),
    "launcher_override_given_twice": Case(["--training.steps given twice"], extra=["--training.steps", "8"], nproc=2),
    "launcher_dump_folder_locked": Case(
        ["in use by another run", f"pid {os.getpid()}"], nproc=2, prepare=hold_the_lock
    ),
    "launcher_shard_corrupted_on_rank_1s_share": Case(
        ["__1_0.distcp: shard file is corrupted"],
        CHECKPOINTING,
        nproc=2,
        prepare=with_checkpoint(flip_bytes_in_last_shard),
    ),
}


# ---------------------------------------------------------------- running them


def argv_of(case: Case, case_dir: Path) -> list[str]:
    def fill(text: str) -> str:
        return text.replace(DUMP, str(case_dir / "out")).replace(CASE, str(case_dir))

    argv = ["--config", fill(case.config)] if case.config else []
    for key, value in {**SMALL_RUN, "job.dump_folder": DUMP, **case.overrides}.items():
        argv += [f"--{key}", fill(value)]
    return argv + case.extra


def command_of(case: Case, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    if case.nproc > 1:
        return [
            sys.executable,
            "-m",
            "titanlite.launch",
            "--standalone",
            f"--nproc-per-node={case.nproc}",
            "-m",
            "titanlite.train",
            *argv,
        ], run_env()
    command = [sys.executable, "-m", "titanlite.train", *argv]
    if case.shell_prefix:
        command = ["bash", "-c", f'{case.shell_prefix}; exec "$0" "$@"', *command]
    return command, {**{k: v for k, v in run_env().items() if k not in LAUNCHER_ENV}, **rank_env(case)}


def rank_env(case: Case) -> dict[str, str]:
    """What torchrun would tell a case's process that is rank 0 of `world_size`."""
    return {"RANK": "0", "WORLD_SIZE": str(case.world_size)} if case.world_size > 1 else {}


def in_one_interpreter(case: Case) -> bool:
    """A one-process case runs with the others through `titanlite.train.main` in one
    interpreter (`mains_command`, as `run_mains` does: each its own exit code, stdout and
    stderr, and its own RANK and WORLD_SIZE), which pays the imports once; launcher runs and a
    shell prefix (a ulimit) need their own process."""
    return case.nproc == 1 and not case.shell_prefix


def run_plain_cases(pool: ThreadPoolExecutor, names: dict[str, Path]) -> dict[str, Future]:
    """name -> a Future of its Run, all resolved when the one interpreter running them ends."""
    env = {k: v for k, v in run_env().items() if k not in LAUNCHER_ENV}
    runs = {
        name: {"argv": argv_of(CASES[name], folder), "env": rank_env(CASES[name])} for name, folder in names.items()
    }
    # run_command: a hang is killed, and a process the cases leave behind fails them
    batch = pool.submit(run_command, mains_command("titanlite.train", list(runs.values())), env, PLAIN_TIMEOUT_S)
    futures = {name: Future() for name in runs}

    def resolve(done: Future) -> None:
        try:
            results = split_mains("titanlite.train", list(runs.values()), done.result())
        except BaseException as error:  # a hang, a process left behind, a case that did not finish: each fails
            for future in futures.values():
                future.set_exception(error)
            return
        for (name, run), result in zip(runs.items(), results):
            command = [sys.executable, "-m", "titanlite.train", *run["argv"]]
            futures[name].set_result(Run(command, result.returncode, result.stdout, result.stderr, 0.0))

    batch.add_done_callback(resolve)
    return futures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real 2-process (FSDP 2) checkpoint of the debug model at step 1, with checksums."""
    source = Case([], CHECKPOINTING, nproc=2)
    dump = tmp_path_factory.mktemp("source")
    run = run_command(*command_of(source, argv_of(source, dump)))
    assert run.returncode == 0, run.describe()
    assert len(list((dump / "out" / "checkpoint" / "step-1").glob("*.distcp"))) == 2
    return dump / "out" / "checkpoint"


def selected_cases(request) -> list[str]:
    """The cases this pytest session runs (all, or those picked with -k), plain ones first."""
    names = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.module.__name__ == __name__ and hasattr(item, "callspec")
    }
    return sorted(names, key=lambda n: (CASES[n].nproc, list(CASES).index(n)))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, checkpoint) -> dict[str, tuple[Path, Future]]:
    """The selected cases prepared, then all started up front, two at a time, the launcher
    ones last. name -> (the case's folder, its Run to come)."""
    cleanups: list[Callable[[], None]] = []
    folders = {}
    for name in selected_cases(request):
        folders[name] = tmp_path_factory.mktemp(name)
        case = CASES[name]
        if case.prepare is not None and (cleanup := case.prepare(folders[name], checkpoint)) is not None:
            cleanups.append(cleanup)
    plain = [name for name in folders if in_one_interpreter(CASES[name])]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            name: pool.submit(run_command, *command_of(CASES[name], argv_of(CASES[name], path)))
            for name, path in folders.items()
            if name not in plain
        }
        runs.update(run_plain_cases(pool, {name: folders[name] for name in plain}))
        yield {name: (folders[name], runs[name]) for name in folders}
    for cleanup in cleanups:
        cleanup()


def test_the_table_is_large_and_covers_the_launcher():
    assert len(CASES) >= 40 and sum(case.nproc > 1 for case in CASES.values()) >= 3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_no_traceback(name, runs):
    case_dir, future = runs[name]
    run: Run = future.result()
    assert run.returncode == 2, f"expected exit code 2\n{run.describe()}"
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("titanlite: error: "), (
        f"expected one error line on stderr\n{run.describe()}"
    )
    assert "Traceback" not in run.output, run.describe()
    assert len(lines[0]) <= MAX_ERROR_LINE, f"{len(lines[0])} characters: {lines[0]!r}"
    for text in CASES[name].mentions:
        filled = text.replace(DUMP, str(case_dir / "out")).replace(CASE, str(case_dir))
        assert filled in lines[0], f"the error line does not name {filled!r}: {lines[0]!r}"
