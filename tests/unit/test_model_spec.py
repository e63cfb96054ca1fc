"""The typed model contract (model_spec.py): each capability a run needs is refused when the
run is planned, in one line naming the option, for a model that does not declare it; and every
registered model's declarations hold for its code."""

from __future__ import annotations

import dataclasses
import inspect
import types

from pathlib import Path

import pytest
import torch

from tests.helpers.hf_models import hf_folder
from titanlite import build
from titanlite.build import plan_run
from titanlite.config import load_config
from titanlite.errors import TitanliteError
from titanlite.generate.load import LoadedModel
from titanlite.generate.stages import StageForward
from titanlite.model_spec import AttentionWidths, Capabilities, DecoderArgs, ModelSpec
from titanlite.models import _registry, get_model_spec
from titanlite.models.moe import moe_layers
from titanlite.parallel.context_parallel import ContextParallelModel
from titanlite.parallel.mesh import Meshes
from titanlite.parallel.pipeline import split_stage
from titanlite.parallel.pipeline_plan import plan_layout

VOCAB = 64
EVERYTHING = Capabilities(pipeline_split=True, context_parallel=True, document_mask=True, kv_cache=True)

# capability lacking: (world size, the options that need it, the option the line names, what it says is missing)
NEEDED = {
    "pipeline_split": (
        2,
        ["--parallelism.pipeline_parallel_degree", "2"],
        "parallelism.pipeline_parallel_degree",
        "pipeline split",
    ),
    "context_parallel": (
        2,
        ["--parallelism.context_parallel_degree", "2"],
        "parallelism.context_parallel_degree",
        "context-parallel attention",
    ),
    "document_mask": (1, ["--model.attn_mask_type", "block_causal"], "model.attn_mask_type", "document masking"),
    "hf_adapter": (
        1,
        ["--checkpoint.initial_load_format", "hf", "--checkpoint.initial_load_path", "/nowhere"],
        "checkpoint.initial_load_format",
        "Hugging Face mapping",
    ),
    "hf_adapter_on_save": (
        1,
        ["--checkpoint.last_save_in_hf", "true"],
        "checkpoint.last_save_in_hf",
        "Hugging Face mapping",
    ),
}


def stand_in(lacking: str) -> ModelSpec:
    """Llama's spec under another name, declaring everything Llama has but `lacking`."""
    llama = get_model_spec("llama3")
    if lacking.startswith("hf_adapter"):
        return dataclasses.replace(llama, name="stand_in", hf_adapter=None)
    return dataclasses.replace(llama, name="stand_in", capabilities=dataclasses.replace(EVERYTHING, **{lacking: False}))


def plan(overrides: list[str], world: int, spec: ModelSpec, monkeypatch):
    monkeypatch.setattr(build, "get_model_spec", lambda name, flavor=None: spec)
    cfg = load_config(
        [
            "--config",
            "debug_model",
            "--training.local_batch_size",
            "4",
            "--training.mixed_precision_param",
            "float32",
            *overrides,
        ]
    )
    return plan_run(cfg, world, vocab_size=VOCAB)


@pytest.mark.parametrize("lacking", NEEDED)
def test_a_run_needing_a_capability_the_model_lacks_is_refused_when_planned(lacking, monkeypatch):
    world, overrides, option, missing = NEEDED[lacking]
    with pytest.raises(TitanliteError) as refused:
        plan(overrides, world, stand_in(lacking), monkeypatch)
    line = str(refused.value)
    assert line.startswith(f"{option}: model stand_in has no {missing}") and "\n" not in line, line
    # The same run with a model that declares it plans.
    assert plan(overrides, world, get_model_spec("llama3"), monkeypatch).spec.name == "llama3"


def test_a_model_without_document_masking_keeps_its_args_under_causal_attention(monkeypatch):
    spec = stand_in("document_mask")
    assert plan([], 1, spec, monkeypatch).model_args == spec.args_for("debugmodel", VOCAB)


def test_generation_recomputes_for_a_model_without_a_kv_cache(monkeypatch):
    """The KV cache is a capability generation falls back from, not one it refuses."""
    for spec, cached in ((stand_in("kv_cache"), False), (get_model_spec("llama3"), True)):
        planned = plan([], 1, spec, monkeypatch)
        loaded = LoadedModel(planned, Meshes(None, None, None, None), [spec.model_class(planned.model_args)])
        assert StageForward(loaded, torch.device("cpu")).enable_kv_cache(16) is cached


def test_the_refusal_says_what_the_model_needs():
    line = stand_in("pipeline_split").lacks("pipeline_split")
    assert (
        "skip the top-level modules the stage holds as None" in line and "ModelSpec.capabilities.pipeline_split" in line
    )


def test_gpt2_declares_what_its_code_supports_today():
    gpt2 = get_model_spec("gpt2")
    assert gpt2.capabilities == Capabilities(pipeline_split=True, document_mask=True)
    assert not gpt2.supports("hf_adapter") and get_model_spec("llama3").capabilities == EVERYTHING


# ---------------------------------------------------------------- declarations hold


def tiny(spec: ModelSpec, folder: Path) -> torch.nn.Module:
    """The debug flavor, or a tiny Llama's HF folder for a model built from its folder."""
    torch.manual_seed(0)
    args = spec.folder_args(str(hf_folder(folder, "llama"))) if spec.folder_args else spec.args_for("debugmodel", VOCAB)
    model = spec.model_class(args)
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("name", sorted(_registry()))
def test_each_declared_capability_holds_for_the_models_code(name, tmp_path):
    spec = get_model_spec(name)
    declared = spec.capabilities
    if declared.pipeline_split:  # two stages run through the model's own forward give its logits
        model = tiny(spec, tmp_path)
        layout = plan_layout(
            load_config(["--config", "debug_model", "--parallelism.pipeline_parallel_degree", "2"]).parallelism,
            len(model.layers),
            2,
        )
        first, last = (split_stage(model, stage) for stage in layout.stages)
        tokens = torch.randint(0, VOCAB, (2, 8))
        with torch.no_grad():
            torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=0)
    if declared.context_parallel:
        assert issubclass(spec.model_class, ContextParallelModel)
    if declared.document_mask:
        assert "document_ids" in inspect.signature(spec.model_class.forward).parameters
        assert all("attn_mask_type" in {f.name for f in dataclasses.fields(args)} for args in spec.flavors.values())
    if declared.kv_cache:
        assert callable(getattr(spec.model_class, "enable_kv_cache", None))
    # MoE: declared exactly when some flavor builds MoE layers (the planner and MFU count active parameters).
    shapes = [spec.args_for(flavor, VOCAB) for flavor in spec.flavors]
    if spec.folder_args:  # a model built from its folder: a dense one and an MoE one
        shapes = [spec.folder_args(str(hf_folder(tmp_path, kind))) for kind in ("llama", "mixtral")]
    with torch.device("meta"):
        has_experts = any(moe_layers(spec.model_class(args)) for args in shapes)
    assert declared.moe == has_experts


# ---------------------------------------------------------------- typed arguments


@pytest.mark.parametrize("name", sorted(_registry()))
def test_the_args_tell_the_planner_what_the_model_builds(name):
    """Every flavor satisfies DecoderArgs, and a debug flavor's answers (attention widths, MoE
    blocks) are the built model's: the planner reads them instead of assuming GQA."""
    spec = get_model_spec(name)
    assert all(isinstance(args, DecoderArgs) for args in spec.flavors.values())
    for flavor in [f for f in spec.flavors if f.startswith("debugmodel")]:
        args = spec.args_for(flavor, VOCAB)
        with torch.device("meta"):
            model = spec.model_class(args)
        blocks = range(args.n_layers + args.mtp_depths)  # multi-token prediction blocks after the others
        moe_blocks = [f"layers.{i}.feed_forward" for i in blocks if args.moe_layer(i)]
        assert list(moe_layers(model)) == moe_blocks and len(moe_blocks) == args.n_moe_layers
        attention = model.layers["0"].attention if hasattr(model.layers["0"], "attention") else None
        if attention is not None and hasattr(attention, "wk"):  # GQA's projections (GPT-2 fuses them)
            widths = (attention.wq.out_features, attention.wk.out_features, attention.wv.out_features)
            assert args.attention_widths == AttentionWidths(*widths, out=attention.wo.in_features, latent=0)
        elif attention is not None and hasattr(
            attention, "wkv_b"
        ):  # MLA: keys as wide as queries, values as wo's input
            q = (attention.wq if hasattr(attention, "wq") else attention.wq_b).out_features
            widths, out = args.attention_widths, attention.wo.in_features
            assert (widths.q, widths.k, widths.v, widths.out) == (q, q, out, out) and widths.latent > 0
        else:
            assert args.attention_widths == AttentionWidths(args.dim, args.dim, args.dim, args.dim)


def test_a_flavor_without_the_typed_fields_is_refused_naming_what_it_lacks():
    llama = get_model_spec("llama3")
    with pytest.raises(TypeError, match=r"model odd flavor tiny: its args lack DecoderArgs' .*max_seq_len.*n_layers"):
        dataclasses.replace(llama, name="odd", flavors={"tiny": types.SimpleNamespace(dim=8, vocab_size=8)})
