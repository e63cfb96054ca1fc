"""titanlite/config/torchtitan.py through `load_config`: torchtitan's names for titanlite's
options, its options titanlite lacks (a note when off, one line when on), its downloads, and
`model.hf_assets_path` resolved to a tokenizer file (data/tokenizers)."""

from __future__ import annotations

import pytest

from titanlite.config import load_config
from titanlite.data.tokenizers import tokenizer_file
from titanlite.errors import TitanliteError


def loaded(*argv: str) -> tuple:
    notices: list[str] = []
    return load_config(["--config", "debug_model", *argv], notices), notices


def test_aliases_set_titanlites_own_keys():
    cfg, notices = loaded(
        "--checkpoint.enable", "--checkpoint.last_save_model_only", "true", "--lr_scheduler.min_lr_factor", "0.1"
    )
    assert (cfg.checkpoint.enable_checkpoint, cfg.checkpoint.model_weights_only, cfg.lr_scheduler.lr_min) == (
        True,
        True,
        0.1,
    )
    assert notices == []


def test_options_titanlite_lacks_are_a_note_when_off_and_refused_when_on():
    _, notices = loaded(
        "--parallelism.enable_async_tensor_parallel", "false", "--metrics.disable_color_printing", "true"
    )
    assert [n.split(" ")[0] for n in notices] == [
        "parallelism.enable_async_tensor_parallel",
        "metrics.disable_color_printing",
    ]
    with pytest.raises(TitanliteError, match="^parallelism.enable_async_tensor_parallel: not supported"):
        loaded("--parallelism.enable_async_tensor_parallel", "true")


def test_enable_wandb_is_titanlites_own_option_with_no_note():
    for value in (False, True):
        cfg, notices = loaded("--metrics.enable_wandb", str(value).lower())
        assert cfg.metrics.enable_wandb is value and notices == []


def test_downloads_are_refused_with_how_to_prepare_local_data_and_a_validation_one_only_when_used():
    with pytest.raises(
        TitanliteError, match=r"^training.dataset: 'c4' is a dataset torchtitan downloads.*titanlite.data.prepare"
    ):
        loaded("--training.dataset", "c4")
    _, notices = loaded("--validation.dataset", "c4_validation")
    assert notices == ["validation.dataset = 'c4_validation': torchtitan's download, not used while validation is off"]
    with pytest.raises(TitanliteError, match="^validation.dataset: 'c4_validation'"):
        loaded("--validation.dataset", "c4_validation", "--validation.enable", "true")


def test_a_command_line_dataset_wins_over_a_files_download(tmp_path):
    """Overrides win everywhere, torchtitan's download in the file included."""
    path = tmp_path / "torchtitan.toml"
    path.write_text('[training]\ndataset = "c4"\n')
    with pytest.raises(TitanliteError, match=r"^training.dataset: 'c4' is a dataset torchtitan downloads"):
        load_config(["--config", str(path)])
    notices: list[str] = []
    cfg = load_config(["--config", str(path), "--training.dataset", "builtin"], notices)
    assert cfg.training.dataset == "builtin"
    assert notices == [f"training.dataset = 'c4' in {path}: torchtitan's download, replaced by the command line's"]


def test_model_converters_say_float8_is_not_supported(tmp_path):
    """torchtitan's 405B file converts the model to float8."""
    path = tmp_path / "torchtitan.toml"
    path.write_text('[model]\nconverters = ["float8"]\n')
    with pytest.raises(
        TitanliteError, match=r"^model.converters: float8 is not supported \(titanlite has no float8 or mx"
    ):
        load_config(["--config", str(path)])
    path.write_text("[model]\nconverters = []\n")
    notices: list[str] = []
    load_config(["--config", str(path)], notices)
    assert notices == [f"model.converters = [] in {path}: torchtitan's option, no conversion; titanlite has none"]


def test_selective_ac_option_is_a_number_or_op():
    assert (
        loaded("--activation_checkpoint.selective_ac_option", "op")[0].activation_checkpoint.selective_ac_option == "op"
    )
    for bad in ("0", "two", "-1"):
        with pytest.raises(
            TitanliteError, match="^activation_checkpoint.selective_ac_option: must be a whole number >= 1 or op"
        ):
            loaded("--activation_checkpoint.selective_ac_option", bad)


def test_a_toml_number_for_selective_ac_option_and_a_byte_order_mark_are_read(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes('\ufeff[activation_checkpoint]\nmode = "selective"\nselective_ac_option = 3\n'.encode())
    assert load_config(["--config", str(path)]).activation_checkpoint.selective_ac_option == "3"


def test_a_section_set_as_a_key_is_named_a_section(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("training = 5\n")
    with pytest.raises(
        TitanliteError, match=r"^training in .* is a section, not a key: write \[training\] and its keys under it$"
    ):
        load_config(["--config", str(path)])


def test_hf_assets_path_finds_the_tokenizer_file_in_the_folder(tmp_path):
    assert tokenizer_file("assets/tokenizer/titanlite.model") == "assets/tokenizer/titanlite.model"
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_text("x")
    assert tokenizer_file("ignored", str(tmp_path)) == str(tmp_path / "original" / "tokenizer.model")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_file("ignored", str(tmp_path)) == str(tmp_path / "tokenizer.json")
    with pytest.raises(TitanliteError, match="^model.hf_assets_path: .* is not a folder"):
        tokenizer_file("ignored", str(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TitanliteError, match="^model.hf_assets_path: .* holds no tokenizer file"):
        tokenizer_file("ignored", str(tmp_path / "empty"))


def test_an_empty_choice_is_shown_as_empty_quotes():
    with pytest.raises(TitanliteError, match=r'^validation.dataset: must be one of "", builtin, files, prepared'):
        loaded("--validation.dataset", "web")
