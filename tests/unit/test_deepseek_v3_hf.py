"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM` (models/deepseek_v3/hf_adapter.py
through checkpoint/hf_io.py), at one process.

Both ways and both query paths (tests/helpers/hf_deepseek_v3.py: low-rank q with YaRN, plain
q), with group-limited MoE blocks, an expert bias and a dense block: transformers' model saved
with `save_pretrained` (one tensor per expert) gives our model its logits (1e-4 in float32
through `scripts/convert_hf.py from-hf`, 1e-6 in float64 through `hf_io.read_hf_model`), and
our model, every weight drawn, written by `to-hf` / `hf_io.save_hf_weights`, gives
transformers ours. config.json round-trips for every flavor and names each mismatch; the MTP
layers of DeepSeek's published files are skipped; fp8 files and flavors transformers' class
cannot hold are refused in one line. The sharded paths (FSDP 2, ep 2) are
tests/runs/test_hf_sharded.py's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.hf_deepseek_v3 import TINY, hf_logits, randomize, save_source
from tests.helpers.scripts import script_main
from titanlite.checkpoint import export, hf_io
from titanlite.errors import TitanliteError
from titanlite.models.deepseek_v3 import DeepSeekV3, deepseek_v3_hf as hf_adapter
from titanlite.models.rope import YaRN

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def convert():
    return script_main("convert_hf.py")


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def drawn_model(args, seed: int) -> DeepSeekV3:
    """Our model with every weight and expert bias drawn (as the HF source's are)."""
    model = DeepSeekV3(args)
    model.init_weights(seed=seed)  # the RoPE table; the weights come next
    tensors = dict(model.named_parameters())
    tensors.update({name: b for name, b in model.named_buffers() if name.endswith("expert_bias")})
    randomize(tensors, seed)
    return model.eval()


@pytest.mark.parametrize("kind", list(TINY))
def test_transformers_folder_converts_both_ways_with_its_logits(tmp_path, kind):
    args = TINY[kind]
    reference = save_source(args, tmp_path)
    source = weight_map(tmp_path / "hf")
    assert len(set(source.values())) > 2  # several files
    # transformers writes each expert as its own tensor, the bias beside the router
    assert {"model.layers.2.mlp.experts.7.up_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias"} <= set(
        source
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_adapter.check_hf_config(config, args) == []
    assert hf_adapter.args_from_hf_config(config) == args
    assert convert()(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0  # the model from model_type
    ours = DeepSeekV3(args)
    ours.init_weights(seed=5)
    ours.load_state_dict(export.read_dcp_model(tmp_path / "dcp"))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(reference["tokens"]), reference["logits"], rtol=1e-4, atol=1e-4)
    assert convert()(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--max-shard-size", "8KB"]) == 0
    assert weight_map(tmp_path / "back").keys() == source.keys()
    torch.testing.assert_close(
        hf_logits(tmp_path / "back", reference["tokens"]), reference["logits"], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kind", list(TINY))
def test_float64_logits_equal_transformers_both_ways(tmp_path, kind):
    """HF -> ours from transformers' float64 files, and ours -> HF from our drawn float64
    model: the logits agree to 1e-6 both ways."""
    args = TINY[kind]
    reference = save_source(args, tmp_path / "theirs", dtype=torch.float64)
    ours = DeepSeekV3(args)
    ours.init_weights(seed=5)
    ours.load_state_dict(hf_io.read_hf_model(tmp_path / "theirs" / "hf", hf_adapter, args, DeepSeekV3))
    with torch.no_grad():
        logits = ours.double().eval()(reference["tokens"])
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-6, atol=1e-6)

    mine = drawn_model(args, seed=11).double()  # floating tensors only: the RoPE table stays complex
    hf_io.save_hf_weights(mine.state_dict(), tmp_path / "mine", hf_adapter, args, max_file_bytes=4096)
    with torch.no_grad():
        expected = mine(reference["tokens"])
    theirs = hf_logits(tmp_path / "mine", reference["tokens"], dtype=torch.float64)
    torch.testing.assert_close(theirs, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(theirs, reference["logits"], atol=1e-2)  # another model than the source


def test_sharded_io_writes_what_to_hf_maps_and_reads_it_back(tmp_path):
    """hf_io's per-expert plan (one process) writes exactly the adapter's to_hf tensors, the
    expert bias as e_score_correction_bias, and reads them back into the stacked experts;
    from_hf inverts to_hf."""
    from safetensors.torch import load_file

    args = TINY["q_lora"]
    state = drawn_model(args, seed=3).state_dict()
    hf_io.save_hf_weights(state, tmp_path / "hf", hf_adapter, args, max_file_bytes=4096)
    written = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    mapped = hf_adapter.to_hf(state, args)
    assert written.keys() == mapped.keys() and all(torch.equal(written[k], mapped[k]) for k in mapped)
    assert torch.equal(
        mapped["model.layers.2.mlp.gate.e_score_correction_bias"], state["layers.2.feed_forward.expert_bias"]
    )
    back = hf_io.read_hf_model(tmp_path / "hf", hf_adapter, args, DeepSeekV3)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    unmapped = hf_adapter.from_hf(mapped, args)
    assert unmapped.keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in unmapped.items())


def test_mtp_layers_are_skipped_and_fp8_files_refused(tmp_path, capsys):
    """DeepSeek's published files hold the multi-token prediction module as one layer past
    num_hidden_layers (num_nextn_predict_layers 1): it loads without it. Their fp8 form
    (quantization_config) is refused in one line."""
    from safetensors.torch import save_file

    args = TINY["plain_q"]
    reference = save_source(args, tmp_path)
    folder = tmp_path / "hf"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    mtp = {f"model.layers.{args.n_layers}.eh_proj.weight": torch.ones(4, 4)}
    save_file(mtp, folder / "mtp.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ours = DeepSeekV3(args)
    ours.init_weights(seed=5)
    ours.load_state_dict(hf_io.read_hf_model(folder, hf_adapter, args, DeepSeekV3))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(reference["tokens"]), reference["logits"], rtol=1e-4, atol=1e-4)

    fp8 = {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    (folder / "config.json").write_text(json.dumps(fp8))
    capsys.readouterr()
    assert convert()(["from-hf", str(folder), str(tmp_path / "out.pt")]) == 2
    assert capsys.readouterr().err == (
        f"titanlite: error: {folder / 'config.json'}: this DeepSeek-V3 cannot hold: fp8 quantized weights "
        "(dequantize them to bf16 first)\n"
    )
    assert hf_adapter.check_hf_config(fp8, args) == ["quantization_config fp8 (this model: None)"]


def test_what_transformers_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    args = TINY["plain_q"]
    softmax = dataclasses.replace(
        args, moe=dataclasses.replace(args.moe, score_func="softmax", use_expert_bias=False, n_shared_experts=0)
    )
    with pytest.raises(
        TitanliteError, match="cannot hold this model: softmax router scores .* no expert bias .* no shared"
    ):
        hf_io.save_hf_weights(DeepSeekV3(softmax).state_dict(), tmp_path / "out", hf_adapter, softmax)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert hf_adapter.hf_export_problems(args) == []


def test_every_flavors_config_round_trips():
    """Every flavor transformers' class can hold; the others (softmax routers: torchtitan's 16B)
    are told apart by config.json, so an HF folder does not load into them."""
    from titanlite.models.deepseek_v3 import deepseek_v3_spec

    flavors = dict(deepseek_v3_spec.flavors) | TINY
    held = {name: args for name, args in flavors.items() if not hf_adapter.hf_export_problems(args)}
    assert {"debugmodel", "debugmodel_q_lora", "671B"} <= set(held)
    for name, flavor in flavors.items():
        if name not in held:
            sigmoid = dataclasses.replace(flavor, moe=dataclasses.replace(flavor.moe, score_func="sigmoid"))
            assert "scoring_func sigmoid (this model: softmax)" in hf_adapter.check_hf_config(
                hf_adapter.hf_config(sigmoid), flavor
            )
    for name, flavor in held.items():
        args = dataclasses.replace(flavor, vocab_size=129280)
        config = hf_adapter.hf_config(args)
        assert hf_adapter.args_from_hf_config(config, flavor) == args, name
        assert hf_adapter.check_hf_config(config, args) == [], name
        assert hf_adapter.hf_config(hf_adapter.args_from_hf_config(config)) == config, name  # no base flavor
        transformers.DeepseekV3Config.from_dict(config)  # transformers reads it


# deepseek-ai/DeepSeek-V3's config.json as published (its auto_map and token ids left out).
PUBLISHED_671B = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_the_published_config_is_the_671b_flavor_once_dequantized():
    from titanlite.models.deepseek_v3 import deepseek_v3_spec

    flavor = deepseek_v3_spec.args_for("671B", 129280)
    assert hf_adapter.check_hf_config(PUBLISHED_671B, flavor) == ["quantization_config fp8 (this model: None)"]
    bf16 = {key: value for key, value in PUBLISHED_671B.items() if key != "quantization_config"}
    assert hf_adapter.check_hf_config(bf16, flavor) == []
    assert hf_adapter.args_from_hf_config(bf16, deepseek_v3_spec.flavors["671B"]) == flavor


def test_the_config_check_names_each_mismatch():
    args = TINY["q_lora"]
    config = hf_adapter.hf_config(args)
    changed = {
        **config,
        "q_lora_rank": None,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "routed_scaling_factor": 1.0,
        "rope_parameters": {**config["rope_parameters"], "mscale_all_dim": 1.0},
    }
    assert hf_adapter.check_hf_config(changed, args) == [
        "q_lora_rank 0 (this model: 24)",
        "rope_parameters.mscale_all_dim 1.0 (this model: 0.8)",
        "routed_scaling_factor 1.0 (this model: 2.5)",
        "n_group 2 (this model: 4)",
        "topk_group 1 (this model: 2)",
        "first_k_dense_replace 0 (this model: 1)",
    ]
    # DeepSeek's own config.json form: rope_scaling with "type" and a top-level rope_theta
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
    assert hf_adapter.check_hf_config(legacy, args) == []
    plain = TINY["plain_q"]
    assert hf_adapter.check_hf_config(
        hf_adapter.hf_config(plain), dataclasses.replace(plain, rope_scaling=YaRN(40.0, 4096))
    ) == ["rope_type default (this model: yarn)"]
    assert hf_adapter.check_hf_config({**config, "model_type": "qwen3"}, args) == [
        "model_type 'qwen3' (this model: 'deepseek_v3')"
    ]
