"""titanlite/config/torchtitan.py through `load_config`: torchtitan's names for titanlite's
options, its options titanlite lacks (a note when off, one line when on), its downloads, its
model families (torchtitan's flavor shapes for a torchtitan file, a family titanlite lacks named
first), and `model.hf_assets_path` resolved to a tokenizer file (data/tokenizers)."""

from __future__ import annotations

import pytest

from titanlite.config.param_groups import DEFAULT_GROUPS
from titanlite.config import load_config, torchtitan
from titanlite.data.tokenizers import tokenizer_file
from titanlite.errors import TitanliteError
from titanlite.models import _registry, get_model_spec
from titanlite.models.deepseek_v3 import deepseek_v3_torchtitan_flavors
from titanlite.models.llama import llama3_flavors, llama3_torchtitan_flavors
from titanlite.models.qwen3 import qwen3_flavors, qwen3_torchtitan_flavors


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
    assert cfg.training.dataset == "builtin" and cfg.model.flavor == "torchtitan:debugmodel"  # torchtitan's file
    assert notices[2:] == [f"training.dataset = 'c4' in {path}: torchtitan's download, replaced by the command line's"]


def test_a_torchtitan_file_decays_every_parameter_unless_it_names_groups(tmp_path):
    """torchtitan has no parameter groups: its file trains with one weight decay for all, with a
    notice; titanlite's own files keep the default groups, and named groups win in either."""
    path = tmp_path / "torchtitan.toml"
    path.write_text('[training]\ndataset = "c4"\n')
    notices: list[str] = []
    cfg = load_config(["--config", str(path), "--training.dataset", "builtin"], notices)
    assert cfg.optimizer.param_groups == [] and notices[0].startswith(
        f"optimizer.param_groups = [] in {path}: torchtitan decays"
    )
    assert load_config(["--config", "debug_model"]).optimizer.param_groups == list(DEFAULT_GROUPS)
    group = "*.bias: weight_decay=0"
    named = load_config(["--config", str(path), "--training.dataset", "builtin", "--optimizer.param_groups", group])
    assert named.optimizer.param_groups == [group]


def test_model_converters_take_float8_and_refuse_mx_naming_its_hardware(tmp_path):
    """torchtitan's 405B file converts the model to float8 (tests/unit/test_float8.py: the rest)."""
    path = tmp_path / "torchtitan.toml"
    path.write_text('[model]\nconverters = ["float8"]\n')
    assert load_config(["--config", str(path)]).model.converters == ["float8"]
    path.write_text('[model]\nconverters = ["mx"]\n')
    with pytest.raises(TitanliteError, match=r"^model.converters: mx is not supported: MXFP8 needs an SM100 GPU"):
        load_config(["--config", str(path)])


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


def test_expert_tensor_parallel_degree_is_titanlites_own_key():
    """torchtitan's MoE files set it to 1; titanlite reads it as its own key (1, or
    tensor_parallel_degree: parallel/expert_tensor_parallel.py), with no notice."""
    cfg, notices = loaded("--parallelism.expert_tensor_parallel_degree", "1")
    assert notices == [] and cfg.parallelism.expert_tensor_parallel_degree == 1


def test_a_torchtitan_model_family_titanlite_lacks_is_named_before_the_keys_of_its_file(tmp_path):
    path = tmp_path / "llama4.toml"
    path.write_text('[parallelism]\nenable_async_tensor_parallel = true\n[model]\nname = "llama4"\n')
    with pytest.raises(TitanliteError, match=rf"^model.name: 'llama4' in {path} is a torchtitan model family"):
        load_config(["--config", str(path)])
    with pytest.raises(TitanliteError) as refused:
        load_config(["--config", "debug_model", "--model.name", "llama4"])
    assert str(refused.value) == (
        "model.name: 'llama4' on the command line is a torchtitan model family titanlite does not have; "
        "torchtitan's deepseek_v3, llama3 and qwen3 files run here"
    )
    # the command line's model wins; then the file's keys are read
    with pytest.raises(TitanliteError, match="^parallelism.enable_async_tensor_parallel: not supported"):
        load_config(["--config", str(path), "--model.name", "llama3"])


def test_the_torchtitan_families_are_titanlites_or_named_absent():
    registered = set(_registry())
    assert set(torchtitan.SHARED_MODELS) <= registered
    assert not set(torchtitan.ABSENT_MODELS) & registered
    for name, spec in _registry().items():
        prefixed = [flavor for flavor in spec.flavors if flavor.startswith(torchtitan.FLAVOR_PREFIX)]
        assert bool(prefixed) == (name in torchtitan.SHARED_MODELS), name


def test_a_torchtitan_file_gets_torchtitans_flavor_and_a_titanlite_file_its_own(tmp_path):
    path = tmp_path / "qwen3_moe_debug.toml"
    path.write_text('[model]\nname = "qwen3"\nflavor = "debugmodel_moe"\n[checkpoint]\nenable = false\n')
    notices: list[str] = []
    assert load_config(["--config", str(path)], notices).model.flavor == "torchtitan:debugmodel_moe"
    assert notices[-1] == (
        f"model.flavor = 'debugmodel_moe' in {path}: the file is torchtitan's, so torchtitan's debugmodel_moe "
        "shape (torchtitan:debugmodel_moe; titanlite's own flavors are for titanlite's files)"
    )
    notices = []
    cfg = load_config(["--config", str(path), "--model.flavor", "0.6B"], notices)
    assert (
        cfg.model.flavor == "torchtitan:0.6B" and "'0.6B' on the command line: the file is torchtitan's" in notices[-1]
    )
    # already torchtitan's, another family, a titanlite file (a torchtitan name on the command line included)
    assert load_config(["--config", str(path), "--model.flavor", "torchtitan:8B"]).model.flavor == "torchtitan:8B"
    path.write_text('[model]\nname = "gpt2"\n[checkpoint]\nenable = false\n')
    assert load_config(["--config", str(path)]).model.flavor == "debugmodel"
    path.write_text('[model]\nname = "qwen3"\nflavor = "debugmodel_moe"\n[checkpoint]\nenable_checkpoint = false\n')
    assert load_config(["--config", str(path), "--checkpoint.enable", "false"]).model.flavor == "debugmodel_moe"
    path.write_text('[model]\nname = "deepseek_v3"\nflavor = "16B"\n[checkpoint]\nenable = false\n')
    assert load_config(["--config", str(path)]).model.flavor == "torchtitan:16B"
    for config in ("debug_model", "llama_8b", "qwen3_30b_a3b"):
        assert not load_config(["--config", config]).model.flavor.startswith("torchtitan:"), config


def test_torchtitans_flavors_have_torchtitan_v0_2_2s_shapes():
    """torchtitan/models/{llama3,qwen3}/__init__.py at v0.2.2, field by field; published sizes are ours."""
    debug = llama3_torchtitan_flavors["debugmodel"]
    assert (debug.dim, debug.n_layers, debug.n_heads, debug.kv_heads, debug.head_dim, debug.ffn_hidden_dim) == (
        256,
        6,
        16,
        16,
        16,
        768,
    )
    assert (debug.rope_theta, debug.rope_scaling, debug.norm_eps) == (500000.0, (8.0, 1.0, 4.0, 8192), 1e-5)
    assert all(llama3_torchtitan_flavors[name] is llama3_flavors[name] for name in ("8B", "70B", "405B"))
    for name in ("debugmodel", "debugmodel_moe"):
        args = qwen3_torchtitan_flavors[name]
        shape = (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.hidden_dim)
        assert shape == (256, 8, 16, 8, 128, 3072) and args.max_seq_len == 4096 and args.rope_theta == 1e6
    assert qwen3_torchtitan_flavors["debugmodel"].tie_word_embeddings
    assert not qwen3_torchtitan_flavors["debugmodel_moe"].tie_word_embeddings
    for name, (experts, hidden) in {
        "debugmodel_moe": (64, 768),
        "30B-A3B": (128, 768),
        "235B-A22B": (128, 1536),
    }.items():
        moe = qwen3_torchtitan_flavors[name].moe
        assert (moe.n_experts, moe.top_k, moe.hidden_dim, moe.n_shared_experts, moe.score_func) == (
            experts,
            8,
            hidden,
            0,
            "softmax",
        )
        # route_norm, load_balance_coeff 1e-3 (the expert bias), no aux loss
        assert moe.renormalize and moe.use_expert_bias and moe.bias_update_rate == 1e-3 and moe.aux_loss_coef == 0
    assert qwen3_torchtitan_flavors["235B-A22B"].rope_theta == 5e6
    assert all(qwen3_torchtitan_flavors[n] is qwen3_flavors[n] for n in ("0.6B", "1.7B", "4B", "8B", "14B", "32B"))
    for spec, table in (
        (get_model_spec("llama3"), llama3_torchtitan_flavors),
        (get_model_spec("qwen3"), qwen3_torchtitan_flavors),
        (get_model_spec("deepseek_v3"), deepseek_v3_torchtitan_flavors),
    ):
        assert all(spec.flavors[f"torchtitan:{name}"] is args for name, args in table.items())


# torchtitan/models/deepseek_v3/__init__.py at v0.2.2: (dim, inter_dim, moe_inter_dim, n_layers, n_dense_layers,
# n_heads, q_lora_rank) and MoEArgs (num_experts, num_shared_experts, top_k, num_expert_groups or 1 for None,
# num_limited_groups or 1, score_func, route_norm, route_scale).
TORCHTITAN_DEEPSEEK_V3 = {
    "debugmodel": ((256, 1024, 256, 6, 1, 16, 0), (8, 2, 3, 1, 1, "softmax", False, 1.0)),
    "16B": ((2048, 10944, 1408, 27, 1, 16, 0), (64, 2, 6, 1, 1, "softmax", False, 1.0)),
    "671B": ((7168, 18432, 2048, 61, 3, 128, 1536), (256, 1, 8, 8, 4, "sigmoid", True, 2.5)),
}


@pytest.mark.parametrize("name", list(TORCHTITAN_DEEPSEEK_V3))
def test_torchtitans_deepseek_v3_flavors_have_torchtitan_v0_2_2s_shapes(name):
    """Field by field; every flavor has MLA's published widths (kv_lora_rank 512, heads of 128 + 64
    rotary, values of 128), torchtitan's norm eps 1e-5 and load_balance_coeff 1e-3 (the expert bias),
    and no YaRN: torchtitan scales RoPE only for a training.seq_len above 4096, which is refused here."""
    args = deepseek_v3_torchtitan_flavors[name]
    shape, routing = TORCHTITAN_DEEPSEEK_V3[name]
    assert (args.dim, args.hidden_dim, args.moe.hidden_dim, args.n_layers, args.n_dense_layers) == shape[:5]
    assert (args.n_heads, args.q_lora_rank) == shape[5:]
    assert (args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim) == (512, 128, 64, 128)
    moe = args.moe
    assert (moe.n_experts, moe.n_shared_experts, moe.top_k, moe.n_group, moe.topk_group) == routing[:5]
    assert (moe.score_func, moe.renormalize, moe.route_scale) == routing[5:]
    assert moe.use_expert_bias and moe.bias_update_rate == 1e-3 and moe.aux_loss_coef == 0
    assert (args.norm_eps, args.rope_theta, args.rope_scaling, args.max_seq_len) == (1e-5, 10000.0, None, 4096)
