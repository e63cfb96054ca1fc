"""Qwen3 and Qwen3-MoE <-> Hugging Face (models/qwen3/hf_adapter.py through checkpoint/hf_io.py).

transformers' tiny Qwen3 and Qwen3-MoE, saved with `save_pretrained` in several files (one
tensor per expert: what the installed transformers writes), convert with
`scripts/convert_hf.py from-hf` into our model with transformers' logits (1e-4), and back
with `to-hf` into a folder of the same tensor names that transformers loads with the same
logits. config.json round-trips and names each mismatch; a flavor with what
Qwen3MoeForCausalLM cannot hold (an expert bias) is refused before anything is written, and
loads from HF with its bias zero. The sharded paths (FSDP 2) are tests/runs/test_hf_sharded.py's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.scripts import script_main
from tests.helpers.hf_qwen3 import TINY, hf_logits, save_source
from titanlite.checkpoint import export, hf_io
from titanlite.errors import TitanliteError
from titanlite.models.qwen3 import Qwen3, qwen3_hf as hf_adapter, qwen3_flavors

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def convert():
    return script_main("convert_hf.py")


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.mark.parametrize("kind", list(TINY))
def test_save_pretrained_converts_both_ways_with_transformers_logits(tmp_path, kind):
    args = TINY[kind]
    reference = save_source(args, tmp_path)
    source = weight_map(tmp_path / "hf")
    assert len(set(source.values())) > 2  # several files
    if args.moe is not None:  # transformers writes each expert as its own tensor
        assert (
            "model.layers.2.mlp.experts.2.up_proj.weight" in source and "model.layers.1.mlp.gate_proj.weight" in source
        )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_adapter.check_hf_config(config, args) == []
    assert convert()(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0  # the model from model_type
    ours = Qwen3(hf_adapter.args_from_hf_config(config))
    ours.init_weights(seed=5)  # the RoPE table; the weights come next
    ours.load_state_dict(export.read_dcp_model(tmp_path / "dcp"))
    with torch.no_grad():
        torch.testing.assert_close(ours(reference["tokens"]), reference["logits"], rtol=1e-4, atol=1e-4)
    assert convert()(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--max-shard-size", "8KB"]) == 0
    assert weight_map(tmp_path / "back").keys() == source.keys()
    torch.testing.assert_close(
        hf_logits(tmp_path / "back", reference["tokens"]), reference["logits"], rtol=1e-5, atol=1e-5
    )


def test_from_hf_names_the_folders_model_type_when_the_model_does_not_read_it(tmp_path, capsys):
    """`--model llama3` on a Qwen3-MoE folder (the default --model once) blamed a missing
    intermediate_size; a model_type no registered model reads is named too."""
    save_source(TINY["qwen3_moe"], tmp_path)
    config_path = tmp_path / "hf" / "config.json"
    capsys.readouterr()
    assert convert()(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out.pt"), "--model", "llama3"]) == 2
    assert capsys.readouterr().err == (
        f"titanlite: error: --model: llama3 does not read {config_path}: its model_type is 'qwen3_moe'; "
        "pass --model qwen3\n"
    )
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "model_type": "mistral"}))
    assert convert()(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out.pt")]) == 2
    assert capsys.readouterr().err == (
        f"titanlite: error: {config_path}: model_type 'mistral' is not one titanlite converts "
        "('deepseek_v3', 'gpt_oss', 'llama', 'qwen3', 'qwen3_moe')\n"
    )
    assert not (tmp_path / "out.pt").exists()


def test_sharded_io_writes_what_to_hf_maps_and_reads_it_back(tmp_path):
    """hf_io's per-expert plan (one process) writes exactly the adapter's to_hf tensors, and
    reads them back into the stacked experts; from_hf inverts to_hf."""
    from safetensors.torch import load_file

    args = TINY["qwen3_moe"]
    model = Qwen3(args)
    model.init_weights(seed=3)
    state = model.state_dict()
    hf_io.save_hf_weights(state, tmp_path / "hf", hf_adapter, args, max_file_bytes=4096)
    written = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    mapped = hf_adapter.to_hf(state, args)
    assert written.keys() == mapped.keys() and all(torch.equal(written[k], mapped[k]) for k in mapped)
    back = hf_io.read_hf_model(tmp_path / "hf", hf_adapter, args, Qwen3)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    unmapped = hf_adapter.from_hf(mapped, args)
    assert unmapped.keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in unmapped.items())


def test_an_expert_bias_is_refused_on_export_and_zero_from_hf(tmp_path):
    from titanlite.build import plan_run
    from titanlite.config.load import load_config

    aux = TINY["qwen3_moe"]
    biased = dataclasses.replace(aux, moe=dataclasses.replace(aux.moe, use_expert_bias=True))
    model = Qwen3(biased)
    model.init_weights(seed=0)
    with pytest.raises(
        TitanliteError,
        match=r"an expert bias \(DeepSeek-V3's balancing; MoEArgs.use_expert_bias\) \(Qwen3-MoE has none\)$",
    ):
        hf_io.save_hf_weights(model.state_dict(), tmp_path / "out", hf_adapter, biased)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    argv = ["--config", "debug_model", "--model.name", "qwen3", "--checkpoint.last_save_in_hf", "true"]
    with pytest.raises(
        TitanliteError, match="^checkpoint.last_save_in_hf: model qwen3 debugmodel_moe has what .* expert bias"
    ):
        plan_run(load_config([*argv, "--model.flavor", "debugmodel_moe"]), 1, vocab_size=64)
    plan_run(load_config([*argv, "--model.flavor", "debugmodel_moe_aux"]), 1, vocab_size=64)
    hf_io.save_hf_weights(Qwen3(aux).state_dict(), tmp_path / "hf", hf_adapter, aux)
    loaded = hf_io.read_hf_model(tmp_path / "hf", hf_adapter, biased, Qwen3)  # the bias HF lacks: zero
    assert all(torch.equal(loaded[f"layers.{i}.feed_forward.expert_bias"], torch.zeros(3)) for i in (0, 2))


@pytest.mark.parametrize("flavor", list(qwen3_flavors))
def test_every_flavors_config_round_trips(flavor):
    args = dataclasses.replace(qwen3_flavors[flavor], vocab_size=151936)
    config = hf_adapter.hf_config(args)
    again = hf_adapter.args_from_hf_config(config, qwen3_flavors[flavor])
    assert again == args and hf_adapter.check_hf_config(config, args) == []
    assert hf_adapter.hf_config(hf_adapter.args_from_hf_config(config)) == config  # without a base flavor


def test_the_config_check_names_each_mismatch():
    moe = TINY["qwen3_moe"]
    config = hf_adapter.hf_config(moe)
    changed = {
        **config,
        "num_experts": 8,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
        "head_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5.0},
        "router_aux_loss_coef": 0.5,
    }
    assert hf_adapter.check_hf_config(changed, moe) == [
        "head_dim 8 (this model: 16)",
        "rope_theta 5.0 (this model: 1000000.0)",
        "num_experts 8 (this model: 3)",
        "norm_topk_prob False (this model: True)",
        "mlp_only_layers [] (this model: [1])",
    ]  # the aux coefficient trains, it does not change the function
    assert hf_adapter.check_hf_config(config, TINY["qwen3"]) == ["model_type 'qwen3_moe' (this model: 'qwen3')"]
    yarn = {**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}
    assert hf_adapter.check_hf_config(yarn, moe) == [
        "unreadable RoPE settings (rope type 'yarn' is not supported (Qwen3 here has default RoPE only))"
    ]
    older = {k: v for k, v in config.items() if k != "rope_parameters"}  # transformers 4: top-level rope_theta
    assert hf_adapter.check_hf_config(older, moe) == []
