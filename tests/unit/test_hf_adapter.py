"""Hugging Face models as the installed transformers writes them, into titanlite and back.

A tiny `LlamaForCausalLM` saved with `save_pretrained` (RoPE under `rope_parameters` in
transformers >= 5), and the same folder rewritten the way older versions wrote it
(top-level `rope_theta` / `rope_scaling`), convert with `scripts/convert_hf.py from-hf`
into a model whose logits equal transformers' to 1e-4. A config.json that differs from the
flavor in RoPE or norm eps is refused in one line on every load path. The mapping itself
(RoPE permutation, names, config.json) is checked exactly at the end.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.scripts import script_main
from tests.helpers.stand_ins import TINY, tiny_model
from titanlite.checkpoint import hf_io
from titanlite.errors import TitanliteError
from titanlite.models.llama import llama3_hf as hf_adapter
from titanlite.models.llama.model import Llama, LlamaArgs
from titanlite.models.rope import apply_rope, rope_cos_sin

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SHAPE = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "llama3": {**LLAMA3_ROPE, "rope_theta": 500000.0},
}


def convert():
    return script_main("convert_hf.py")


def save_pretrained(folder: Path, rope: str) -> "transformers.LlamaForCausalLM":
    """A tiny random Llama, saved by the installed transformers exactly as a user would."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, rope_parameters=dict(ROPES[rope]), attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def as_older_transformers(folder: Path) -> None:
    """Rewrite config.json the way transformers 4.x wrote it: RoPE at top level, `type`."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    path.write_text(json.dumps(config))


def ours_from_pt(path: Path, args: LlamaArgs) -> Llama:
    model = Llama(args)
    model.init_weights(seed=0)  # builds the RoPE table (a buffer); the weights come next
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


@pytest.mark.parametrize("older", [False, True], ids=["current", "older_layout"])
@pytest.mark.parametrize("rope", list(ROPES))
def test_save_pretrained_converts_with_equal_logits(tmp_path, rope, older):
    hf_model = save_pretrained(tmp_path / "hf", rope)
    if older:
        as_older_transformers(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert ("rope_parameters" in config) != older  # the layout under test is really there
    assert convert()(["from-hf", str(tmp_path / "hf"), str(tmp_path / "model.pt")]) == 0
    args = hf_adapter.args_from_hf_config(config)
    assert args.rope_theta == 500000.0 and (args.rope_scaling is None) == (rope == "default")
    ours = ours_from_pt(tmp_path / "model.pt", args)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf_model(tokens).logits, rtol=1e-4, atol=1e-4)


def test_our_export_with_rope_scaling_loads_in_transformers(tmp_path):
    args = LlamaArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=96,
        multiple_of=32,
        max_seq_len=64,
        rope_theta=500000.0,
        rope_scaling=(8.0, 1.0, 4.0, 16),
    )
    ours = Llama(args)
    ours.init_weights(seed=3)
    hf_io.save_hf_weights(ours.state_dict(), tmp_path / "hf", hf_adapter, args)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager"
    )
    assert hf_model.config.rope_parameters["rope_type"] == "llama3"
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change, mentions",
    [
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            "rope_theta 10000.0 (this model: 500000.0)",
        ),
        ({"rms_norm_eps": 1e-6}, "rms_norm_eps 1e-06 (this model: 1e-05)"),
        (
            {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}},
            "rope_scaling (8.0, 1.0, 4.0, 16) (this model: None)",
        ),
        ({"tie_word_embeddings": True}, "tie_word_embeddings True (this model: False)"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0}},
            "rope type 'yarn' is not supported",
        ),
    ],
)
def test_initial_hf_load_refuses_a_config_of_another_model(tmp_path, change, mentions):
    """`checkpoint.initial_load_format hf` reads through `export.load_hf`: the config is
    compared with the flavor before a tensor is read."""
    save_pretrained(tmp_path / "hf", "default")
    args = hf_adapter.args_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert hf_io.read_hf_model(tmp_path / "hf", hf_adapter, args, Llama).keys() == Llama(args).state_dict().keys()
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(TitanliteError, match="config.json: describes another model") as info:
        hf_io.read_hf_model(tmp_path / "hf", hf_adapter, args, Llama)
    assert mentions in str(info.value) and "\n" not in str(info.value)


def test_a_safetensors_file_the_index_does_not_name_is_refused_not_read(tmp_path):
    """DCP's Hugging Face reader reads every *.safetensors in the folder: a stray file's
    norm of 5.0 would replace the indexed one without a word (convert_hf's read; the
    trainer's initial load and generate check the folder with the same function)."""
    import safetensors.torch as st

    save_pretrained(tmp_path / "hf", "default")
    args = hf_adapter.args_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    if not (tmp_path / "hf" / hf_io.HF_INDEX_FILE).exists():  # one file: index it, as a sharded save would
        names = st.load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
        (tmp_path / "hf" / hf_io.HF_INDEX_FILE).write_text(
            json.dumps({"weight_map": {n: "model.safetensors" for n in names}})
        )
    stray = tmp_path / "hf" / "extra.safetensors"
    st.save_file({"model.norm.weight": torch.full((args.dim,), 5.0)}, str(stray), metadata={"format": "pt"})
    with pytest.raises(TitanliteError) as info:
        hf_io.read_hf_model(tmp_path / "hf", hf_adapter, args, Llama)
    assert str(info.value).startswith(f"{stray}: model.safetensors.index.json does not name this file")


def test_a_folder_without_an_index_refuses_a_tensor_in_two_files_and_a_foreign_one(tmp_path, capsys):
    """transformers' single-file save has no index, and DCP's reader then reads every
    *.safetensors: a second file holding the norm (5.0) was loaded over the model's without a
    word. A tensor in two files names both files; one the model lacks names its file; each is
    one line from convert_hf.py too, and nothing is written."""
    import safetensors.torch as st

    save_pretrained(tmp_path / "hf", "default")
    folder, single = tmp_path / "hf", tmp_path / "hf" / "model.safetensors"
    assert single.is_file() and not (folder / hf_io.HF_INDEX_FILE).exists()  # transformers' single-file save
    args = hf_adapter.args_from_hf_config(json.loads((folder / "config.json").read_text()))
    assert hf_io.read_hf_model(folder, hf_adapter, args, Llama).keys() == Llama(args).state_dict().keys()
    note = f"(the folder has no {hf_io.HF_INDEX_FILE}, so every *.safetensors in it is read)"

    second = folder / "extra.safetensors"
    st.save_file({"model.norm.weight": torch.full((args.dim,), 5.0)}, str(second), metadata={"format": "pt"})
    with pytest.raises(TitanliteError) as info:
        hf_io.read_hf_model(folder, hf_adapter, args, Llama)
    assert str(info.value) == (
        f"{single}: tensor model.norm.weight is also in {second}; a Hugging Face folder holds each tensor in one "
        f"file {note}: move one of them out"
    )
    capsys.readouterr()
    assert convert()(["from-hf", str(folder), str(tmp_path / "out.pt")]) == 2
    assert capsys.readouterr().err == f"titanlite: error: {info.value}\n"

    st.save_file({"model.extra.weight": torch.zeros(args.dim)}, str(second), metadata={"format": "pt"})
    with pytest.raises(TitanliteError) as info:
        hf_io.read_hf_model(folder, hf_adapter, args, Llama)
    assert str(info.value) == f"{second}: tensor model.extra.weight is not part of this model {note}"
    assert not (tmp_path / "out.pt").exists()


def test_from_hf_with_a_flavor_of_another_theta_is_one_line(tmp_path, capsys):
    """The debug model's shapes, saved by transformers with its default theta 10,000: the
    flavor's 500,000 is not what this folder holds."""
    from titanlite.models import get_model_spec

    flavor = hf_adapter.hf_config(get_model_spec("llama3", "debugmodel").args_for("debugmodel", 96))
    config = transformers.LlamaConfig(
        **{k: flavor[k] for k in (*SHAPE, "head_dim")}, rope_parameters={"rope_type": "default"}
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert convert()(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out.pt"), "--flavor", "debugmodel"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"titanlite: error: --flavor: debugmodel does not match {tmp_path / 'hf' / 'config.json'}: "
        "rope_theta 10000.0 (this model: 500000.0)"
    )
    assert not (tmp_path / "out.pt").exists()


def test_rope_settings_read_either_place():
    llama3 = (8.0, 1.0, 4.0, 16)
    assert hf_adapter.rope_settings({}) == (10000.0, None)  # transformers' defaults
    assert hf_adapter.rope_settings({"rope_theta": 5.0, "rope_scaling": None}) == (5.0, None)
    assert hf_adapter.rope_settings(
        {
            "rope_theta": 5.0,
            "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}},
        }
    ) == (5.0, llama3)
    assert hf_adapter.rope_settings({"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 7.0}}) == (7.0, llama3)
    with pytest.raises(ValueError, match="per layer type"):
        hf_adapter.rope_settings({"rope_parameters": {"full_attention": {"rope_theta": 1.0}}})
    exported = hf_adapter.hf_config(dataclasses.replace(LlamaArgs(), rope_scaling=llama3))
    assert hf_adapter.rope_settings(exported) == (LlamaArgs().rope_theta, llama3)
    assert hf_adapter.rope_settings({k: v for k, v in exported.items() if k != "rope_parameters"}) == (
        LlamaArgs().rope_theta,
        llama3,
    )


def test_a_model_converted_without_a_flavor_goes_back_to_hugging_face(tmp_path):
    """from-hf without --flavor records the model as flavor "hf"; to-hf of that folder rebuilds
    its hyperparameters from the record and writes logits equal to the original's."""
    hf_model = save_pretrained(tmp_path / "hf", "default")
    assert convert()(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    assert convert()(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "back", dtype=torch.float32, attn_implementation="eager"
    )
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, hf_model(tokens).logits, rtol=1e-5, atol=1e-5)


# ---------------------- the mapping itself (it needs no transformers; the module skips without it)


def test_rope_permutation_is_an_inverse_pair():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(hf_adapter.half_to_interleaved(hf_adapter.interleaved_to_half(w, 4), 4), w)


def test_rope_permutation_maps_interleaved_rope_to_rotate_half_rope():
    """Our interleaved RoPE on wq equals HF's rotate-half RoPE on the permuted wq, up to
    the same per-head reordering of features (which attention scores do not see)."""
    args = TINY
    x = torch.randn(1, 5, args.dim)
    wq = torch.randn(args.n_heads * args.head_dim, args.dim)
    cos_sin = rope_cos_sin(args, "cpu")
    ours = apply_rope((x @ wq.T).view(1, 5, args.n_heads, args.head_dim), cos_sin)
    q_hf = (x @ hf_adapter.interleaved_to_half(wq, args.n_heads).T).view(1, 5, args.n_heads, args.head_dim)
    cos, sin = cos_sin[:5].real, cos_sin[:5].imag  # the table holds cos + i*sin
    cos, sin = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    half = args.head_dim // 2
    rotate_half = torch.cat([-q_hf[..., half:], q_hf[..., :half]], -1)
    hf = q_hf * cos + rotate_half * sin
    ours_as_half = torch.cat([ours[..., 0::2], ours[..., 1::2]], -1)
    torch.testing.assert_close(hf, ours_as_half, rtol=1e-5, atol=1e-5)


def test_hf_names_and_round_trip_are_exact():
    state = tiny_model().state_dict()
    hf = hf_adapter.to_hf(state, TINY)
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
    } <= set(hf)
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (TINY.kv_heads * TINY.head_dim, TINY.dim)
    back = hf_adapter.from_hf(hf, TINY)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_hf_config_check_names_each_mismatch():
    config = hf_adapter.hf_config(TINY)
    assert hf_adapter.check_hf_config(config, TINY) == []
    assert hf_adapter.check_hf_config({**config, "num_key_value_heads": None}, TINY) == [
        "num_key_value_heads 4 (this model: 2)"
    ]
    assert hf_adapter.check_hf_config(config, dataclasses.replace(TINY, n_layers=3, vocab_size=100)) == [
        "num_hidden_layers 2 (this model: 3)",
        "vocab_size 96 (this model: 100)",
    ]


def test_hf_config_round_trips_to_args():
    for args in (TINY, dataclasses.replace(TINY, rope_scaling=(8.0, 1.0, 4.0, 8192), ffn_dim_multiplier=1.3)):
        config = hf_adapter.hf_config(args)
        again = hf_adapter.args_from_hf_config(config)
        assert hf_adapter.hf_config(again) == config
