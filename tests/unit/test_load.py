"""titanlite/config/load.py: TOML + CLI overrides -> one validated JobConfig, errors naming section.key;
the shipped presets, the blend syntax, help and TOML output. (The sections themselves:
test_sections.py; the engine on a made-up schema: test_engine.py; `python -m titanlite.config`:
tests/runs/test_load.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from titanlite.config import JobConfig, help_text, load_config, parse_blend, to_dict, to_toml, validate
from titanlite.config.engine import sections
from titanlite.errors import TitanliteError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.name for p in (REPO / "train_configs").glob("*.toml"))


def write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(argv: list[str]) -> str:
    with pytest.raises(TitanliteError) as info:
        load_config(argv)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- loading -----------------------------------------------------------------------------


def test_ships_the_four_presets():
    assert {"debug_model.toml", "llama_8b.toml", "llama_70b.toml", "llama_405b.toml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads_and_round_trips(name, tmp_path):
    cfg = load_config(["--config", name])
    again = load_config(["--config", write(tmp_path, to_toml(cfg))])
    assert again == cfg


def test_debug_model_is_the_cpu_default():
    cfg = load_config(["--config", "debug_model"])
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "debugmodel")
    assert (cfg.training.local_batch_size, cfg.training.seq_len, cfg.training.steps) == (8, 256, 100)
    assert cfg.training.dataset == "builtin"
    assert cfg.training.mixed_precision_param == "auto"
    assert cfg.optimizer.lr == 8e-4 and cfg.lr_scheduler.warmup_steps == 10
    assert not cfg.checkpoint.enable_checkpoint and cfg.checkpoint.interval == 50
    assert cfg.metrics.enable_tensorboard and cfg.parallelism.data_parallel_shard_degree == -1


@pytest.mark.parametrize(
    "name, flavor, lr, tp, ac",
    [
        ("llama_8b", "8B", 3e-4, 1, "selective"),
        ("llama_70b", "70B", 1.5e-4, 8, "full"),
        ("llama_405b", "405B", 8e-5, 8, "full"),
    ],
)
def test_llama_presets_carry_the_published_settings(name, flavor, lr, tp, ac):
    cfg = load_config(["--config", name])
    assert cfg.model.flavor == flavor and cfg.optimizer.lr == lr
    assert cfg.parallelism.tensor_parallel_degree == tp and cfg.activation_checkpoint.mode == ac
    assert cfg.training.seq_len == 8192
    assert (cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce) == ("bfloat16", "float32")
    assert cfg.checkpoint.enable_checkpoint and cfg.checkpoint.interval == 500
    assert cfg.model.tokenizer_path == "assets/tokenizer/llama/tokenizer.model"
    assert (cfg.training.dataset, cfg.training.dataset_path) == ("files", "data/")


@pytest.mark.parametrize(
    "name, flavor, tp",
    [
        ("qwen3_8b", "8B", 1),
        ("qwen3_32b", "32B", 8),
        ("qwen3_30b_a3b", "30B-A3B", 1),
        ("qwen3_235b_a22b", "235B-A22B", 1),
    ],
)
def test_qwen3_presets_carry_the_published_architecture_and_torchtitans_settings(name, flavor, tp):
    cfg = load_config(["--config", name])
    assert (cfg.model.name, cfg.model.flavor, cfg.parallelism.tensor_parallel_degree) == ("qwen3", flavor, tp)
    assert (cfg.optimizer.lr, cfg.lr_scheduler.warmup_steps, cfg.training.seq_len, cfg.training.steps) == (
        8e-4,
        600,
        4096,
        3000,
    )
    assert cfg.activation_checkpoint.mode == "full" and cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.model.hf_assets_path == f"assets/hf/Qwen3-{flavor}"


@pytest.mark.parametrize("name", ["debug_model", "debug_model.toml", "train_configs/debug_model.toml"])
def test_config_lookup_by_bare_name_or_path(name, monkeypatch):
    monkeypatch.chdir(REPO)
    assert load_config(["--config", name]).training.seq_len == 256


def test_bare_name_is_found_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(["--config=debug_model"]).training.seq_len == 256


def test_a_path_in_the_working_directory_wins_over_train_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "[training]\nsteps = 7\n", "debug_model.toml")
    assert load_config(["--config", "debug_model"]).training.steps == 7


def test_no_config_means_the_dataclass_defaults():
    assert load_config([]) == JobConfig()


def test_toml_ints_are_accepted_for_floats(tmp_path):
    cfg = load_config(["--config", write(tmp_path, "[training]\nmax_norm = 2\n[lr_scheduler]\ndecay_ratio = 1\n")])
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.lr_scheduler.decay_ratio == 1.0 and isinstance(cfg.lr_scheduler.decay_ratio, float)


def test_toml_lists_and_none(tmp_path):
    text = '[parallelism]\nfsdp_shard_modules = ["Block", "Attention"]\n[lr_scheduler]\ndecay_ratio = "none"\n'
    cfg = load_config(["--config", write(tmp_path, text)])
    assert cfg.parallelism.fsdp_shard_modules == ["Block", "Attention"]
    assert cfg.lr_scheduler.decay_ratio is None


# --- overrides ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, section, key, expected",
    [
        (["--training.steps", "5"], "training", "steps", 5),
        (["--training.steps=5"], "training", "steps", 5),
        (["--training.global_batch_size", "-1"], "training", "global_batch_size", -1),
        (["--optimizer.lr", "1e-4"], "optimizer", "lr", 1e-4),
        (["--optimizer.lr=0.002"], "optimizer", "lr", 0.002),
        (["--job.description", "hello world"], "job", "description", "hello world"),
        (["--job.description="], "job", "description", ""),
        (["--model.flavor=8B"], "model", "flavor", "8B"),
        (["--training.deterministic"], "training", "deterministic", True),
        (["--training.deterministic", "--training.steps", "5"], "training", "deterministic", True),
        (["--metrics.enable_tensorboard", "false"], "metrics", "enable_tensorboard", False),
        (["--metrics.enable_tensorboard=0"], "metrics", "enable_tensorboard", False),
        (["--metrics.enable_tensorboard", "no"], "metrics", "enable_tensorboard", False),
        (["--metrics.enable_tensorboard=False"], "metrics", "enable_tensorboard", False),
        (["--training.deterministic", "yes"], "training", "deterministic", True),
        (["--training.deterministic=1"], "training", "deterministic", True),
        (["--lr_scheduler.decay_ratio", "0.2"], "lr_scheduler", "decay_ratio", 0.2),
        (["--lr_scheduler.decay_ratio", "none"], "lr_scheduler", "decay_ratio", None),
        (["--lr_scheduler.decay_ratio=None"], "lr_scheduler", "decay_ratio", None),
        (
            ["--parallelism.fsdp_shard_modules", "Block,Attention"],
            "parallelism",
            "fsdp_shard_modules",
            ["Block", "Attention"],
        ),
        (["--parallelism.fsdp_shard_modules", "Block"], "parallelism", "fsdp_shard_modules", ["Block"]),
        (
            ['--parallelism.fsdp_shard_modules=["Block", "Attention"]'],
            "parallelism",
            "fsdp_shard_modules",
            ["Block", "Attention"],
        ),
        (["--parallelism.fsdp_shard_modules="], "parallelism", "fsdp_shard_modules", []),
        (["--parallelism.fsdp_shard_modules", "[]"], "parallelism", "fsdp_shard_modules", []),
    ],
)
def test_overrides_parse_by_field_type(argv, section, key, expected):
    value = getattr(getattr(load_config(argv), section), key)
    assert value == expected and type(value) is type(expected)


def test_overrides_win_over_toml_and_keep_the_rest(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 128\n[lr_scheduler]\ndecay_ratio = 0.5\n")
    cfg = load_config(["--training.steps", "9", "--config", path, "--lr_scheduler.decay_ratio", "none"])
    assert cfg.training.steps == 9 and cfg.training.seq_len == 128
    assert cfg.lr_scheduler.decay_ratio is None


def test_repeated_override_is_an_error():
    with pytest.raises(TitanliteError, match=r"^--training.steps given twice \(5 and 6\)$"):
        load_config(["--training.steps", "5", "--training.steps=6"])


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, name",
    [
        ("training.steps=0", "training.steps"),
        ("training.seq_len=-8", "training.seq_len"),
        ("training.local_batch_size=0", "training.local_batch_size"),
        ("training.max_norm=-1", "training.max_norm"),
        ("training.seed=-1", "training.seed"),
        ("training.global_batch_size=0", "training.global_batch_size"),
        ("training.global_batch_size=-2", "training.global_batch_size"),
        ("metrics.log_freq=0", "metrics.log_freq"),
        ("metrics.peak_flops=-1", "metrics.peak_flops"),
        ("checkpoint.interval=0", "checkpoint.interval"),
        ("checkpoint.keep_latest_k=-1", "checkpoint.keep_latest_k"),
        ("checkpoint.load_step=-2", "checkpoint.load_step"),
        ("profiling.profile_freq=0", "profiling.profile_freq"),
        ("comm.init_timeout_seconds=0", "comm.init_timeout_seconds"),
        ("comm.train_timeout_seconds=-5", "comm.train_timeout_seconds"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("optimizer.lr=-1e-3", "optimizer.lr"),
        ("optimizer.lr=inf", "optimizer.lr"),
        ("optimizer.lr=nan", "optimizer.lr"),
        ("optimizer.beta1=1", "optimizer.beta1"),
        ("optimizer.beta2=-0.1", "optimizer.beta2"),
        ("optimizer.eps=0", "optimizer.eps"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
        ("lr_scheduler.warmup_steps=-1", "lr_scheduler.warmup_steps"),
        ("lr_scheduler.decay_ratio=1.5", "lr_scheduler.decay_ratio"),
        ("lr_scheduler.decay_ratio=-0.1", "lr_scheduler.decay_ratio"),
        ("lr_scheduler.lr_min=1.1", "lr_scheduler.lr_min"),
        ("lr_scheduler.lr_min=-0.5", "lr_scheduler.lr_min"),
        ("parallelism.data_parallel_replicate_degree=0", "parallelism.data_parallel_replicate_degree"),
        ("parallelism.data_parallel_shard_degree=0", "parallelism.data_parallel_shard_degree"),
        ("parallelism.data_parallel_shard_degree=-2", "parallelism.data_parallel_shard_degree"),
        ("parallelism.tensor_parallel_degree=0", "parallelism.tensor_parallel_degree"),
        ("parallelism.fsdp_prefetch_depth=-1", "parallelism.fsdp_prefetch_depth"),
        ("activation_checkpoint.selective_ac_option=0", "activation_checkpoint.selective_ac_option"),
        ("model.tokenizer_path=", "model.tokenizer_path"),
        ("job.dump_folder=", "job.dump_folder"),
    ],
)
def test_range_errors_name_the_key_and_value(override, name):
    message = error_of([f"--{override}"])
    assert message.startswith(f"{name}: must "), message
    assert message.endswith(")") and "(got " in message, message


def test_load_step_needs_checkpointing():
    message = error_of(["--checkpoint.load_step", "10"])
    assert message.startswith("checkpoint.load_step: ") and "checkpoint.enable_checkpoint" in message, message
    assert load_config(["--checkpoint.load_step", "10", "--checkpoint.enable_checkpoint"]).checkpoint.load_step == 10


@pytest.mark.parametrize(
    "name, bad",
    [
        ("optimizer.name", "Adam"),
        ("optimizer.implementation", "fast"),
        ("lr_scheduler.decay_type", "cosin"),
        ("training.dataset", "web"),  # (c4, a download, gets its own line: test_torchtitan.py)
        ("training.mixed_precision_param", "float16"),
        ("training.mixed_precision_reduce", "fp32"),
        ("checkpoint.async_mode", "sync"),
        ("checkpoint.export_dtype", "int8"),
        ("checkpoint.initial_load_format", "safetensors"),
        ("activation_checkpoint.mode", "op"),
    ],
)
def test_choice_errors_list_the_choices(name, bad):
    section, key = name.split(".")
    field = next(f for f in dataclasses.fields(sections(JobConfig)[section]) if f.name == key)
    message = error_of([f"--{name}", bad])
    assert message.startswith(f"{name}: must be one of "), message
    assert all(choice in message for choice in field.metadata["choices"]) and f"(got '{bad}')" in message


@pytest.mark.parametrize("bad", ["sometimes", "0", "-2", "2.5"])
def test_reshard_after_forward_takes_a_policy_or_a_number_of_ranks(bad):
    message = error_of(["--parallelism.fsdp_reshard_after_forward", bad])
    assert message == (
        "parallelism.fsdp_reshard_after_forward: must be default, always, never or a number of "
        f"ranks >= 1 (got '{bad}')"
    )


def test_every_choice_is_accepted():
    for section, cls in sections(JobConfig).items():
        for field in dataclasses.fields(cls):
            for choice in field.metadata["choices"]:
                extra = [f"--{section}.dataset_path", "x"] if choice in ("files", "prepared", "chat") else []
                extra += ["--model.attn_mask_type", "block_causal"] if choice == "chat" else []
                load_config([f"--{section}.{field.name}", choice, *extra])


@pytest.mark.parametrize(
    "argv, start",
    [
        (
            ["--training.local_batch_size", "4", "--training.global_batch_size", "10"],
            "training.global_batch_size: must be -1 or a multiple",
        ),
        (["--training.dataset", "files"], "training.dataset_path: "),
        (["--training.dataset", "prepared"], "training.dataset_path: "),
        (
            ["--training.enable_cpu_offload", "--parallelism.fsdp_reshard_after_forward", "never"],
            "training.enable_cpu_offload: ",
        ),
        (["--parallelism.fsdp_shard_modules", "Block,not a class"], "parallelism.fsdp_shard_modules: "),
    ],
)
def test_consistency_errors(argv, start):
    message = error_of(argv)
    assert message.startswith(start) and "(got " in message, message


def test_consistent_settings_pass():
    load_config(["--training.local_batch_size", "4", "--training.global_batch_size", "16"])
    load_config(["--training.dataset", "files", "--training.dataset_path", "data/"])
    load_config(["--training.enable_cpu_offload", "--parallelism.fsdp_reshard_after_forward", "always"])
    load_config(["--lr_scheduler.decay_ratio", "0", "--lr_scheduler.lr_min", "1", "--training.max_norm", "0"])


def test_empty_path_and_unknown_dataset():
    """Refused here, once: the data sources trust the validated config (moved from the data sources' tests)."""
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: "):
        load_config(["--training.dataset", "files", "--training.dataset_path", ""])
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: "):
        load_config(["--training.dataset=prepared", "--training.dataset_path="])
    with pytest.raises(TitanliteError, match=r"^training\.dataset: .*'parquet'"):
        load_config(["--training.dataset", "parquet", "--training.dataset_path", "x"])


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("seq_len", 0, "training.seq_len: must be > 0 (got 0)"),
        ("seq_len", -3, "training.seq_len: must be > 0 (got -3)"),
        ("local_batch_size", 0, "training.local_batch_size: must be > 0 (got 0)"),
        ("seq_len", 2.5, "training.seq_len: expected an integer (got 2.5)"),
    ],
)
def test_bad_sizes(key, value, message):
    """Batch shapes are checked here, once; the loader trusts them (moved from the data sources' tests)."""
    cfg = JobConfig()
    setattr(cfg.training, key, value)
    with pytest.raises(TitanliteError) as info:
        validate(cfg)
    assert str(info.value) == message


def test_validate_checks_values_set_in_code():
    cfg = JobConfig()
    validate(cfg)
    cfg.training.steps = "10"
    with pytest.raises(TitanliteError, match=r"^training\.steps: expected an integer \(got '10'\)"):
        validate(cfg)
    cfg = JobConfig()
    cfg.optimizer.lr = 1  # an int where a float is declared is fine
    validate(cfg)


def test_first_problem_is_reported():
    message = error_of(["--training.steps", "0", "--optimizer.lr", "0"])
    assert message.startswith("optimizer.lr")  # sections are checked in declaration order


@pytest.mark.parametrize(
    "text, message",
    [
        ("a:0.7,b:x", "'b:x' is not folder:weight"),
        ("a:0,b:0", "sum to 0"),
        ("a:0.5,b", "'b' is not folder:weight"),
        ("a:-1,b:2", "'a:-1' is not"),
        ("a:nan,b:1", "'a:nan' is not"),
        (":1,b:1", "':1' is not"),
    ],
)
def test_blend_syntax_errors_are_one_line(text, message):
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*" + message):
        parse_blend(text, "training.dataset_path")
    assert parse_blend("web:0.7, code:0.3", "f") == [("web", 0.7), ("code", 0.3)] and parse_blend("data/x", "f") == [
        ("data/x", 1.0)
    ]


# --- unknown names, wrong types, files ---------------------------------------------------


def test_unknown_key_in_toml_suggests_the_closest(tmp_path):
    path = write(tmp_path, "[training]\nsq_len = 10\n", "llama_8b.toml")
    assert error_of(["--config", path]) == "unknown key training.sq_len in " + path + "; did you mean training.seq_len?"


def test_unknown_key_in_shipped_name_is_shown_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "[training]\nsq_len = 10\n", "llama_8b.toml")
    assert (
        error_of(["--config", "llama_8b.toml"])
        == "unknown key training.sq_len in llama_8b.toml; did you mean training.seq_len?"
    )


def test_unknown_section_in_toml(tmp_path):
    message = error_of(["--config", write(tmp_path, "[trainig]\nsteps = 10\n")])
    assert message.startswith("unknown section [trainig] in ") and message.endswith("did you mean [training]?")


def test_key_outside_a_section_in_toml(tmp_path):
    message = error_of(["--config", write(tmp_path, "steps = 10\n")])
    assert message.startswith("unknown key steps in ") and message.endswith("did you mean training.steps?")


def test_key_in_the_wrong_section_in_toml(tmp_path):
    message = error_of(["--config", write(tmp_path, "[training]\nwarmup_steps = 10\n")])
    assert message.endswith("did you mean lr_scheduler.warmup_steps?"), message


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--training.sq_len", "unknown key training.sq_len on the command line; did you mean training.seq_len?"),
        ("--trainig.steps", "unknown key trainig.steps on the command line; did you mean training.steps?"),
        ("--steps", "unknown key steps on the command line; did you mean training.steps?"),
        (
            "--optimizer.warmup_steps",
            "unknown key optimizer.warmup_steps on the command line; did you mean lr_scheduler.warmup_steps?",
        ),
        ("--training.zzzzzz", "unknown key training.zzzzzz on the command line"),
    ],
)
def test_unknown_key_on_the_command_line(flag, expected):
    assert error_of([flag, "10"]) == expected
    assert error_of([f"{flag}=10"]) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[training]\nsteps = "ten"\n', "training.steps: expected an integer, got 'ten' in "),
        ("[training]\nsteps = 10.0\n", "training.steps: expected an integer, got 10.0 in "),
        ("[training]\nsteps = true\n", "training.steps: expected an integer, got True in "),
        ('[optimizer]\nlr = "fast"\n', "optimizer.lr: expected a number, got 'fast' in "),
        (
            '[training]\ndeterministic = "yes"\n',
            "training.deterministic: expected a boolean (true/false), got 'yes' in ",
        ),
        ("[model]\nflavor = 8\n", "model.flavor: expected a string, got 8 in "),
        (
            '[parallelism]\nfsdp_shard_modules = "Block"\n',
            "parallelism.fsdp_shard_modules: expected a list of strings, got 'Block' in ",
        ),
        (
            "[parallelism]\nfsdp_shard_modules = [1]\n",
            "parallelism.fsdp_shard_modules: expected a list of strings, got [1] in ",
        ),
        (
            '[lr_scheduler]\ndecay_ratio = "half"\n',
            "lr_scheduler.decay_ratio: expected a number or none, got 'half' in ",
        ),
        ("[training]\nsteps = {a = 1}\n", "training.steps: expected an integer, got {'a': 1} in "),
    ],
)
def test_wrong_type_in_toml(tmp_path, text, expected):
    assert error_of(["--config", write(tmp_path, text)]).startswith(expected)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.steps", "ten"], "training.steps: expected an integer, got 'ten'"),
        (["--training.steps=1.5"], "training.steps: expected an integer, got '1.5'"),
        (["--training.steps="], "training.steps: expected an integer, got ''"),
        (["--optimizer.lr", "fast"], "optimizer.lr: expected a number, got 'fast'"),
        (["--training.deterministic", "maybe"], "training.deterministic: expected a boolean (true/false), got 'maybe'"),
        (["--lr_scheduler.decay_ratio", "half"], "lr_scheduler.decay_ratio: expected a number or none, got 'half'"),
        (
            ["--parallelism.fsdp_shard_modules", "[1, 2]"],
            "parallelism.fsdp_shard_modules: expected a list of strings, got '[1, 2]'",
        ),
        (
            ["--parallelism.fsdp_shard_modules", "[oops"],
            "parallelism.fsdp_shard_modules: expected a list of strings, got '[oops'",
        ),
    ],
)
def test_wrong_type_on_the_command_line(argv, expected):
    assert error_of(argv) == expected


@pytest.mark.parametrize(
    "argv, start",
    [
        (["--training.steps"], "training.steps: --training.steps needs a value (an integer)"),
        (["--training.steps", "--optimizer.lr", "1"], "training.steps: --training.steps needs a value"),
        (["--config"], "--config needs a value"),
        (["--config="], "--config needs a value"),
        (["--config", "debug_model", "--config", "llama_8b"], "--config given twice"),
        (["debug_model"], "unexpected argument 'debug_model'"),
        (["--training.steps", "5", "6"], "unexpected argument '6'"),
        (["-c", "x"], "unexpected argument '-c'"),
    ],
)
def test_malformed_command_lines(argv, start):
    assert error_of(argv).startswith(start)


def test_missing_config_file():
    assert error_of(["--config", "foo.toml"]) == "config file not found: foo.toml (looked in ./ and train_configs/)"
    assert error_of(["--config", "nope"]) == "config file not found: nope (looked in ./ and train_configs/)"


def test_invalid_toml_is_one_line_naming_the_file(tmp_path):
    path = write(tmp_path, "[training]\nsteps = = 3\n")
    message = error_of(["--config", path])
    assert message.startswith(f"invalid TOML in {path}: ") and "line 2" in message


def test_non_utf8_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b'[job]\ndescription = "\xff"\n')
    assert error_of(["--config", str(path)]).startswith(f"invalid TOML in {path}")


# --- help and output ---------------------------------------------------------------------


def test_help_lists_every_key_with_type_default_and_help():
    text = help_text()
    lines = text.splitlines()
    for section, cls in sections(JobConfig).items():
        assert f"[{section}]" in text
        for field in dataclasses.fields(cls):
            flag = f"--{section}.{field.name}"
            index = next(i for i, line in enumerate(lines) if line.split()[:1] == [flag])
            assert " = " in lines[index]  # type and default on the flag's line
            assert field.metadata["help"] in lines[index + 1]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_flag_prints_and_exits_zero(flag, capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--training.steps", "ten", flag])
    assert info.value.code == 0
    assert "--training.seq_len" in capsys.readouterr().out


def test_to_dict_is_nested_plain_data():
    cfg = load_config(["--config", "debug_model"])
    data = to_dict(cfg)
    assert list(data) == [f.name for f in dataclasses.fields(JobConfig)]
    assert data["training"]["seq_len"] == 256 and data["lr_scheduler"]["decay_ratio"] is None
    assert all(type(section) is dict for section in data.values())
    data["parallelism"]["fsdp_shard_modules"].append("X")
    assert cfg.parallelism.fsdp_shard_modules == []


def test_to_toml_round_trips_unusual_values(tmp_path):
    cfg = load_config(
        [
            "--job.description",
            'quotes " and \\ and ünïcode',
            "--lr_scheduler.decay_ratio",
            "0.25",
            "--parallelism.fsdp_shard_modules",
            "A,B",
            "--optimizer.eps",
            "1e-12",
            "--metrics.peak_flops",
            "9.89e14",
        ]
    )
    assert load_config(["--config", write(tmp_path, to_toml(cfg))]) == cfg
