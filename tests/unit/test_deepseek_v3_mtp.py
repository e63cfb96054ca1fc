"""DeepSeek-V3's multi-token prediction (models/deepseek_v3/model.py, step/mtp.py,
hf_adapter.py): the objective against a plain reference written here in float64 (the main
blocks, then each depth's modules applied by hand to the window shifted by that depth, cut where
the window ends, F.cross_entropy); the main loss and gradients at weight 0 equal to the model
without MTP, bit for bit; a Hugging Face folder with DeepSeek's MTP layer loaded whole and
written back byte-equal."""

from __future__ import annotations

import dataclasses
import zlib

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.hf_deepseek_v3 import SMALL_FILES, TINY, hf_logits, randomize, save_source
from titanlite.checkpoint import hf_io
from titanlite.data.loader import IGNORE
from titanlite.models.attention import build_mask
from titanlite.models.deepseek_v3 import deepseek_v3_flavors, deepseek_v3_hf as hf_adapter
from titanlite.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args
from titanlite.step.loss import cross_entropy
from titanlite.step.mtp import MultiTokenPrediction, objective

VOCAB, SEQ, WEIGHT = 96, 16, 0.3
CPU = torch.device("cpu")


def model(depths: int, dtype: torch.dtype = torch.float32) -> DeepSeekV3:
    """The debug model with `depths` MTP modules, its norms' weights random (a swapped norm shows)."""
    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=VOCAB, num_nextn_predict_layers=depths)
    built = DeepSeekV3(args)
    built.init_weights(seed=3)
    with torch.no_grad():
        for name, param in built.named_parameters():
            if "norm" in name:  # keyed by name, as the init: the same in a model with more modules
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    built.to(dtype)
    built.rope_cache = built.rope_table(built.args, CPU)  # complex: `to` a real dtype would drop its imaginary part
    return built


def windows() -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return window[:, :-1], window[:, 1:]


def mtp_loss(built: DeepSeekV3, inputs: torch.Tensor, labels: torch.Tensor, weight: float) -> tuple:
    """(objective, its recorded [main, mtp]) as the step computes them on one process."""
    mtp = MultiTokenPrediction(built.args.mtp_depths, weight, group=None, pp_group=None, device=CPU)
    streams = mtp.streams(labels, IGNORE)
    loss = objective(mtp, built(mtp.streams(inputs, 0)), streams, mtp.divisors(None, [streams], 1), 1.0)
    return loss, mtp.records[0]


def reference(built: DeepSeekV3, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss, mean depth loss) with each module called by hand: depth k runs on the first
    SEQ - k positions, the embeddings of inputs[k:], and predicts labels[k:]."""
    n, depths = built.args.n_layers, built.args.mtp_depths
    cos_sin, mask = built.rope_cache[:SEQ], build_mask("causal", None, None, None, flex=False)
    h = built.tok_embeddings(inputs)
    for i in range(n):
        h = built.layers[str(i)](h, cos_sin, mask)
    main = F.cross_entropy(built.output(built.norm(h)).flatten(0, 1), labels.flatten())
    losses = []
    for k in range(1, depths + 1):
        block, length = built.layers[str(n + k - 1)], SEQ - k
        embedded = built.tok_embeddings(inputs[:, k:])
        x = block.eh_proj(torch.cat([block.enorm(embedded), block.hnorm(h[:, :length])], dim=-1))
        x = x + block.attention(block.attention_norm(x), cos_sin[:length], mask)
        h = x + block.feed_forward(block.ffn_norm(x))
        logits = built.output(block.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten()))
    return main, torch.stack(losses).mean()


def test_the_mtp_objective_equals_the_modules_applied_by_hand_to_the_shifted_window():
    """Two depths, MoE blocks. RoPE rotates in float32 and MoE routes in float32, so a value may
    round one float32 ulp apart between the whole window and the reference's shorter one: the
    losses agree to about 5e-8 relative (an off-by-one shift would be O(1))."""
    built = model(depths=2, dtype=torch.float64)
    inputs, labels = windows()
    loss, (main, mtp) = mtp_loss(built, inputs, labels, WEIGHT)
    expected_main, expected_mtp = reference(built, inputs, labels)
    rtol = 1e-6
    torch.testing.assert_close(main, expected_main, rtol=rtol, atol=0)
    torch.testing.assert_close(mtp, expected_mtp, rtol=rtol, atol=0)
    torch.testing.assert_close(loss, expected_main + WEIGHT * expected_mtp, rtol=rtol, atol=0)
    loss.backward()
    block = built.layers[str(built.args.n_layers + 1)]  # the second depth's
    assert all(p.grad.abs().sum() > 0 for p in (block.eh_proj.weight, block.enorm.weight, block.hnorm.weight))


def test_at_weight_zero_the_main_loss_and_every_gradient_equal_the_model_without_mtp_bit_for_bit():
    plain, with_mtp = model(depths=0), model(depths=1)
    inputs, labels = windows()
    plain_loss = cross_entropy(plain(inputs), labels)
    plain_loss.backward()
    loss, (main, _) = mtp_loss(with_mtp, inputs, labels, weight=0.0)
    loss.backward()
    assert torch.equal(loss, plain_loss) and torch.equal(main, plain_loss.detach())
    grads = dict(with_mtp.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(param.grad, grads[name].grad), name


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for path in sorted(folder.glob("*.safetensors")) for name, t in load_file(path).items()}


def with_mtp_layer(folder: Path, args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    """transformers' folder (it builds no MTP layer) given DeepSeek's layer n_layers as the
    published files hold it: an MTP block's tensors, drawn, in a file of their own, with copies
    of the embedding and the head; config.json's num_nextn_predict_layers 1. Returns every tensor."""
    from safetensors.torch import save_file

    ours = DeepSeekV3(args)
    drawn = dict(ours.named_parameters()) | {k: b for k, b in ours.named_buffers() if k.endswith("expert_bias")}
    randomize(drawn, seed=9)
    source, prefix = tensors(folder), f"model.layers.{args.n_layers}."
    layer = {k: v for k, v in hf_adapter.to_hf(ours.state_dict(), args).items() if k.startswith(prefix)}
    layer |= {prefix + "embed_tokens.weight": source["model.embed_tokens.weight"]}
    layer |= {prefix + "shared_head.head.weight": source["lm_head.weight"]}
    save_file({k: v.contiguous() for k, v in layer.items()}, folder / "model-mtp.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(layer, "model-mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return source | layer


def test_an_hf_folder_loads_its_mtp_layer_whole_and_saves_it_back_byte_equal(tmp_path):
    """Every tensor of the folder is read (the copies of the embedding and the head are the main
    ones: to_hf of what was read gives every tensor back, bit for bit), the main logits are
    transformers', and the folder written back holds the same tensors, byte-equal, which
    transformers loads (dropping the MTP layer, as it does DeepSeek's)."""
    pytest.importorskip("transformers")
    args = dataclasses.replace(TINY["q_lora"], num_nextn_predict_layers=1)
    reference = save_source(TINY["q_lora"], tmp_path)
    folder = tmp_path / "hf"
    source = with_mtp_layer(folder, args)
    config = json.loads((folder / "config.json").read_text())
    assert hf_adapter.args_from_hf_config(config) == args and hf_adapter.check_hf_config(config, args) == []
    state = hf_io.read_hf_model(folder, hf_adapter, args, DeepSeekV3)
    assert state.keys() == DeepSeekV3(args).state_dict().keys() - {"rope_cache"}
    back = hf_adapter.to_hf(state, args)
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)
    ours = DeepSeekV3(args)
    ours.init_weights(seed=5)
    ours.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(reference["tokens"]), reference["logits"], rtol=1e-4, atol=1e-4)

    hf_io.save_hf_weights(state, tmp_path / "back", hf_adapter, args, max_file_bytes=SMALL_FILES)
    written = tensors(tmp_path / "back")
    assert written.keys() == source.keys()
    assert all(
        written[k].dtype == v.dtype and written[k].view(torch.uint8).equal(v.view(torch.uint8))
        for k, v in source.items()
    )
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    torch.testing.assert_close(
        hf_logits(tmp_path / "back", reference["tokens"]), reference["logits"], rtol=1e-5, atol=1e-5
    )


def test_depth_k_leaves_untrained_the_positions_whose_input_lies_in_the_next_document():
    mtp = MultiTokenPrediction(2, WEIGHT, group=None, pp_group=None, device=CPU)
    labels = torch.arange(1, 9)[None]  # the window's tokens 1..8 after inputs 0..7
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    streams = mtp.within_documents(mtp.streams(labels, IGNORE), documents)
    x = IGNORE
    assert streams[0].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [2, 3, x, 5, 6, 7, x, x], [3, x, x, 6, 7, x, x, x]]
