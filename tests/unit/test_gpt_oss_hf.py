"""gpt-oss <-> Hugging Face `GptOssForCausalLM` (models/gpt_oss/hf_adapter.py through
checkpoint/hf_io.py), at one process.

transformers' tiny gpt-oss (tests/helpers/hf_gpt_oss.py: sliding and full layers, nonzero
sinks and biases, clamped experts) saved with `save_pretrained` gives our model its logits
(1e-6 in float64 through `hf_io.read_hf_model`, 1e-4 in float32 through `scripts/convert_hf.py
from-hf`), and our model, every weight drawn, written by `hf_io.save_hf_weights` / `to-hf`,
gives transformers ours. config.json round-trips for every flavor and the published one reads;
MXFP4 folders are refused in one line.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.helpers.hf_gpt_oss import TINY, hf_logits, randomize, save_source
from tests.helpers.scripts import script_main
from titanlite.checkpoint import export, hf_io
from titanlite.errors import TitanliteError
from titanlite.models.gpt_oss import GptOss, gpt_oss_flavors, gpt_oss_hf as hf_adapter

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def convert():
    return script_main("convert_hf.py")


def drawn_model(args, seed: int) -> GptOss:
    model = GptOss(args)
    model.init_weights(seed=seed)  # the RoPE table; the weights come next
    randomize(dict(model.named_parameters()), seed)
    return model.eval()


def test_float64_logits_equal_transformers_both_ways(tmp_path):
    reference = save_source(TINY, tmp_path / "theirs", dtype=torch.float64)
    ours = GptOss(TINY)
    ours.init_weights(seed=5)
    ours.load_state_dict(hf_io.read_hf_model(tmp_path / "theirs" / "hf", hf_adapter, TINY, GptOss))
    with torch.no_grad():
        logits = ours.double().eval()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-6, atol=1e-6)

    mine = drawn_model(TINY, seed=11).double()  # floating tensors only: the RoPE table stays complex
    hf_io.save_hf_weights(mine.state_dict(), tmp_path / "mine", hf_adapter, TINY, max_file_bytes=4096)
    with torch.no_grad():
        expected = mine(reference["tokens"])
    theirs = hf_logits(tmp_path / "mine", reference["tokens"], dtype=torch.float64)
    torch.testing.assert_close(theirs, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(theirs, reference["logits"], atol=1e-2)  # another model than the source


def test_save_pretrained_converts_both_ways_in_float32(tmp_path):
    reference = save_source(TINY, tmp_path)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_adapter.check_hf_config(config, TINY) == []
    assert hf_adapter.args_from_hf_config(config, TINY) == TINY
    assert convert()(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0  # the model from model_type
    ours = GptOss(TINY)
    ours.init_weights(seed=5)
    ours.load_state_dict(export.read_dcp_model(tmp_path / "dcp"))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(reference["tokens"]), reference["logits"], rtol=1e-4, atol=1e-4)
    assert convert()(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--max-shard-size", "8KB"]) == 0
    torch.testing.assert_close(
        hf_logits(tmp_path / "back", reference["tokens"]), reference["logits"], rtol=1e-5, atol=1e-5
    )


def test_sinks_biases_and_the_clamp_change_the_logits(tmp_path):
    """The tiny model exercises what gpt-oss adds: zeroing the sinks, the biases or lifting
    the clamp each moves the logits."""
    model = drawn_model(TINY, seed=3).double()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(tokens)
        for part in ("sinks", "feed_forward.router.gate.bias", "attention.wq.bias"):
            changed = drawn_model(TINY, seed=3).double()
            for name, p in changed.named_parameters():
                if name.endswith(part):
                    p.zero_()
            assert not torch.allclose(changed(tokens), base, atol=1e-3), part
        loose = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, clamped_swiglu=(1.702, 100.0)))
        unclamped = GptOss(loose).double()
        unclamped.init_weights(seed=0)
        unclamped.load_state_dict(model.state_dict())
        assert not torch.allclose(unclamped(tokens), base, atol=1e-3)


def test_every_flavors_config_round_trips_and_the_published_one_reads():
    for name, flavor in {**gpt_oss_flavors, "tiny": TINY}.items():
        args = dataclasses.replace(flavor, vocab_size=201088)
        config = hf_adapter.hf_config(args)
        assert hf_adapter.args_from_hf_config(config, flavor) == args, name
        assert hf_adapter.check_hf_config(config, args) == [], name
        transformers.GptOssConfig.from_dict(config)  # transformers reads it
    published = dict(PUBLISHED_20B)
    twenty = dataclasses.replace(gpt_oss_flavors["20B"], vocab_size=201088)
    assert hf_adapter.check_hf_config(published, twenty) == ["quantization_config mxfp4 (this model: None)"]
    del published["quantization_config"]  # as the published BF16 copies have it
    assert hf_adapter.check_hf_config(published, twenty) == []
    assert hf_adapter.args_from_hf_config(published, twenty) == twenty


def test_mxfp4_folders_are_refused_in_one_line(tmp_path, capsys):
    save_source(TINY, tmp_path)
    folder = tmp_path / "hf"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    capsys.readouterr()
    assert convert()(["from-hf", str(folder), str(tmp_path / "out.pt")]) == 2
    assert capsys.readouterr().err == (
        f"titanlite: error: {folder / 'config.json'}: this gpt-oss cannot hold: mxfp4 quantized experts "
        "(dequantize them to bf16 first)\n"
    )
    with pytest.raises(TitanliteError, match="describes another model: quantization_config mxfp4"):
        hf_io.read_hf_model(folder, hf_adapter, TINY, GptOss)


def test_what_transformers_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    biased = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, use_expert_bias=True))
    with pytest.raises(TitanliteError, match="cannot hold this model: an expert bias"):
        hf_io.save_hf_weights(GptOss(biased).state_dict(), tmp_path / "out", hf_adapter, biased)
    assert not (tmp_path / "out").exists() and hf_adapter.hf_export_problems(TINY) == []


# openai/gpt-oss-20b's config.json as published (its token ids left out).
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}
