"""`--model.name hf` (titanlite/models/hf): a transformers causal LM of any of 13 model types,
built from its folder's config.json, is the transformers model: titanlite's initialized weights
load into transformers' own class under the same names (strict), its logits equal that model's
on the same tokens, and its loss (titanlite's cross-entropy over shifted labels) equals the loss
transformers computes. A plan titanlite cannot apply, a tokenizer with more ids than the model's
table and a folder without config.json are refused when the run is planned, in one line.
(The parallel layouts train like one process in tests/runs/test_parallel_equivalence.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.hf_models import CONFIGS, SHAPE, hf_folder
from titanlite.build import plan_run
from titanlite.config.load import load_config
from titanlite.errors import TitanliteError
from titanlite.models.hf.hf_adapter import folder_adapter
from titanlite.models.moe import MoE
from titanlite.parallel.distributed import shutdown
from titanlite.step.loss import cross_entropy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_models")


@pytest.fixture
def trainer_process(logger_left_as_found):
    """The process group a one-process trainer starts is gone after the test, as at the end of a
    run, and the titanlite logger (set up by the trainer) is as later tests in this process found it."""
    yield
    shutdown()


def hf_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under transformers' names (the HF backend's adapter)."""
    return {folder_adapter.hf_name(key): value for key, value in model.state_dict().items()}


def hf_argv(folder, *extra: str) -> list[str]:
    return ["--config", "debug_model", "--model.name", "hf", "--model.hf_assets_path", str(folder), *extra]


def titanlite_names(theirs: dict[str, torch.Tensor], moe_blocks: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> titanlite's names: the decoder's prefix dropped, and where the
    MoE layer replaced a sparse block, the router's weight, gate_up_proj split into w1 and w3,
    down_proj as w2, the shared experts' projections as w1, w3, w2."""
    ours = {}
    for name, value in theirs.items():
        key = name.removeprefix("model.")
        block = key.split(".")[1] if key.startswith("layers.") else None
        if block is None or int(block) not in moe_blocks or ".mlp." not in key:
            ours[key] = value
            continue
        prefix, rest = key.split(".mlp.")
        mlp = f"{prefix}.mlp"
        if rest == "gate.weight":
            ours[f"{mlp}.router.gate.weight"] = value
        elif rest == "experts.gate_up_proj":
            ours[f"{mlp}.experts.w1"], ours[f"{mlp}.experts.w3"] = value.chunk(2, dim=1)
        elif rest == "experts.down_proj":
            ours[f"{mlp}.experts.w2"] = value
        else:  # shared_experts.{gate,up,down}_proj.weight
            ours[
                f"{mlp}.shared_experts.{dict(gate_proj='w1', up_proj='w3', down_proj='w2')[rest.split('.')[1]]}.weight"
            ] = value
    return ours


@pytest.mark.parametrize("model_type", CONFIGS)
def test_the_model_is_transformers_own_with_its_logits_and_loss(model_type, root):
    """transformers' weights load under titanlite's names (the decoder's prefix dropped; where
    titanlite's MoE layer replaced a sparse block, models/hf/moe.py, its router and experts) and
    give transformers' logits to the bit: the swapped layer routes and sums as the block did
    (two experts per token: the sum of two products is the same in either order)."""
    plan = plan_run(load_config(hf_argv(hf_folder(root, model_type))), 1)
    args = plan.model_args
    assert args.model_type == model_type
    assert args.moe_layers == {"mixtral": (0, 1), "olmoe": (0, 1), "qwen3_moe": (0, 1), "deepseek_v2": (1,)}.get(
        model_type, ()
    )
    ours = plan.spec.model_class(args)
    assert all(isinstance(ours.layers[str(i)].mlp, MoE) for i in args.moe_layers)
    config = transformers.AutoConfig.from_pretrained(root / model_type)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ours.load_state_dict(titanlite_names(theirs.state_dict(), args.moe_layers), strict=True)
    assert len(ours.layers) == config.num_hidden_layers
    tokens = torch.randint(3, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(tokens)
        reference = theirs(input_ids=tokens, labels=tokens)
    assert torch.equal(logits, reference.logits)
    assert cross_entropy(logits[:, :-1], tokens[:, 1:]).item() == pytest.approx(reference.loss.item(), rel=1e-6)


def test_pipeline_stages_run_in_a_row_give_the_whole_models_logits(root, tmp_path):
    """Stages cut as the pipeline cuts them (parallel/pipeline.py: the RoPE table on each,
    the head on the last) and run one after another: the whole model's logits, for a Gemma 3
    whose second stage holds a sliding and a full layer (read by position) and a Granite whose
    embedding multiplier the second stage must not apply again."""
    from titanlite.parallel.pipeline import split_stage
    from titanlite.parallel.pipeline_plan import StageSpec

    layer_types = ["sliding_attention", "full_attention"] * 2
    gemma = dict(num_hidden_layers=4, layer_types=layer_types, tie_word_embeddings=False)
    transformers.Gemma3TextConfig(**{**SHAPE, **CONFIGS["gemma3_text"][1], **gemma}).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes((hf_folder(root, "llama") / "tokenizer.model").read_bytes())
    tokens = torch.randint(3, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    for folder in (tmp_path, hf_folder(root, "granite")):
        plan = plan_run(load_config(hf_argv(folder)), 1)
        with torch.device("meta"):
            whole = plan.spec.model_class(plan.model_args)
        blocks = list(whole.layers)
        first = split_stage(whole, StageSpec(0, tuple(blocks[:1]), True, False))
        second = split_stage(whole, StageSpec(1, tuple(blocks[1:]), False, True))
        for model in (whole, first, second):
            model.to_empty(device="cpu")
            model.init_weights(seed=5)
        assert "rotary_emb" in dict(first.named_children()) and first.norm is None and second.embed_tokens is None
        with torch.no_grad():
            torch.testing.assert_close(second(first(tokens)), whole(tokens), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_block_causal_gives_each_document_its_logits_alone(model_type, root):
    """`model.attn_mask_type block_causal`: titanlite's attention inside the transformers model,
    with the document mask; a window of two documents gives each the logits it has alone (RoPE
    is relative, so the second's later positions change nothing)."""
    plan = plan_run(load_config(hf_argv(hf_folder(root, model_type), "--model.attn_mask_type", "block_causal")), 1)
    with torch.device("meta"):
        model = plan.spec.model_class(plan.model_args)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    tokens = torch.randint(3, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    documents = (torch.arange(24) >= 10).long().expand(2, -1)
    with torch.no_grad():
        together = model(tokens, document_ids=documents)
        alone = torch.cat([model(tokens[:, :10], documents[:, :10]), model(tokens[:, 10:], documents[:, 10:])], 1)
        causal = model.hf(input_ids=tokens).logits
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(together[:, :10], causal[:, :10]) and not torch.allclose(together[:, 10:], causal[:, 10:])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v2"])
def test_an_moe_folder_reads_into_the_swapped_layers_and_writes_back_what_transformers_reads(
    model_type, root, tmp_path
):
    """transformers' files of an MoE model (one tensor per expert, `mlp.experts.E.gate_proj`) read
    per tensor into titanlite's stacked experts and router (checkpoint/hf_io.py through the HF
    backend's adapter) give transformers' logits, and the folder titanlite writes back loads in
    transformers with the same logits."""
    from titanlite.checkpoint import hf_io
    from titanlite.models.hf import HFCausalLM

    args = plan_run(load_config(hf_argv(hf_folder(root, model_type))), 1).model_args
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(args.config(), attn_implementation="sdpa")
    theirs.save_pretrained(tmp_path / "source")
    ours = HFCausalLM(dataclasses.replace(args, folder=str(tmp_path / "source")))
    ours.load_state_dict(hf_io.read_hf_model(tmp_path / "source", folder_adapter, ours.args, HFCausalLM))
    hf_io.save_hf_weights(ours.state_dict(), tmp_path / "saved", folder_adapter, ours.args)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="sdpa")
    tokens = torch.randint(3, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(input_ids=tokens).logits
        assert torch.equal(ours(tokens), expected)
        assert torch.equal(again(input_ids=tokens).logits, expected)


def test_the_init_is_transformers_and_the_same_for_every_seed_and_name(root):
    """Normals of initializer_range for the linears and the table, ones for the norms (a
    Gemma-style norm, 1 + w, zeros): transformers' `_init_weights`; the draws are keyed by
    the seed and the parameter's name (models/init.py), so two builds agree."""
    plan = plan_run(load_config(hf_argv(hf_folder(root, "gemma3_text"))), 1)
    weights = []
    for seed in (5, 5, 6):
        with torch.device("meta"):
            model = plan.spec.model_class(plan.model_args)
        model.to_empty(device="cpu")
        model.init_weights(seed=seed)
        weights.append(dict(model.named_parameters()))
    q = weights[0]["layers.0.self_attn.q_proj.weight"]
    assert q.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(weights[0]["layers.0.input_layernorm.weight"], torch.zeros(64))
    assert torch.equal(q, weights[1]["layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(q, weights[2]["layers.0.self_attn.q_proj.weight"])


def test_a_plan_titanlite_cannot_apply_an_moe_export_and_a_tied_pipeline_are_refused(root):
    with pytest.raises(TitanliteError) as refused:
        plan_run(load_config(hf_argv(hf_folder(root, "deepseek_v2"), "--parallelism.tensor_parallel_degree", "2")), 2)
    assert str(refused.value) == (
        "parallelism.tensor_parallel_degree: deepseek_v2's tensor-parallel plan has styles titanlite cannot apply "
        "(layers.*.self_attn.kv_a_proj_with_mqa: mla_kv_a_proj)"
    )
    plan_run(load_config(hf_argv(hf_folder(root, "deepseek_v2"))), 2)  # FSDP needs no plan
    with pytest.raises(
        TitanliteError, match=r"^checkpoint.last_save_in_hf: .*mixtral's experts under names titanlite does not write$"
    ):
        plan_run(load_config(hf_argv(hf_folder(root, "mixtral"), "--checkpoint.last_save_in_hf", "true")), 1)
    gemma = hf_folder(root, "gemma3_text")  # its head is its embedding table
    with pytest.raises(TitanliteError) as refused:
        plan_run(load_config(hf_argv(gemma, "--parallelism.pipeline_parallel_degree", "2")), 2)
    assert str(refused.value) == (
        f"parallelism.pipeline_parallel_degree: model hf {gemma} shares one tensor between embed_tokens and lm_head, "
        "which sit on the first and the last stage; pipeline an untied model"
    )


def test_a_folder_without_config_or_with_a_smaller_table_is_refused(root, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes((hf_folder(root, "llama") / "tokenizer.model").read_bytes())
    with pytest.raises(TitanliteError, match=r"^model.hf_assets_path: .* holds no config.json$"):
        plan_run(load_config(hf_argv(tmp_path)), 1)
    small = tmp_path / "small"
    transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=1, num_attention_heads=4
    ).save_pretrained(small)
    (small / "tokenizer.model").write_bytes((tmp_path / "tokenizer.model").read_bytes())
    with pytest.raises(TitanliteError) as refused:
        plan_run(load_config(hf_argv(small)), 1)
    assert str(refused.value) == "model.hf_assets_path: the tokenizer has 4096 ids, the model's vocab_size is 1000"


def test_three_trainer_steps_equal_a_plain_torch_loop_over_the_transformers_model(root, tmp_path, trainer_process):
    """The trainer at one process (titanlite's data, loss, AdamW with the default no-decay group,
    warmup, clipping) against a loop written here on transformers' own model from the same
    initial weights and batches: torch's AdamW, its clip_grad_norm_, F.cross_entropy. Every
    tensor within 1e-5 of its norm after 3 steps."""
    from titanlite.step.optim import lr_factor
    from titanlite.trainer import Trainer

    argv = [*hf_argv(hf_folder(root, "qwen3")), "--training.mixed_precision_param", "float32"]
    argv += ["--training.seq_len", "64", "--training.steps", "3", "--lr_scheduler.warmup_steps", "2"]
    argv += ["--optimizer.lr", "3e-3", "--metrics.enable_tensorboard", "false", "--metrics.peak_flops", "1e11"]
    trainer = Trainer(plan_run(load_config([*argv, "--job.dump_folder", str(tmp_path)]), 1))
    cfg = trainer.plan.cfg
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(root / "qwen3"))
    theirs.load_state_dict(hf_names(trainer.model))
    initial = theirs.model.layers[0].mlp.up_proj.weight.detach().clone()
    no_decay = [p for n, p in theirs.named_parameters() if "norm" in n or "embed_tokens" in n]
    decay = [p for n, p in theirs.named_parameters() if not ("norm" in n or "embed_tokens" in n)]
    betas = (cfg.optimizer.beta1, cfg.optimizer.beta2)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optimizer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optimizer.lr,
        betas=betas,
        eps=cfg.optimizer.eps,
        fused=True,  # the trainer's default implementation
    )
    batches = iter(trainer.data)
    for step in range(1, 4):
        inputs, labels = next(batches)
        trainer.train_step([(inputs, labels)])
        for group in optimizer.param_groups:
            group["lr"] = cfg.optimizer.lr * lr_factor(step, 3, 2, None, "linear", 0.0)
        logits = theirs(input_ids=inputs).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), cfg.training.max_norm)
        optimizer.step()
        optimizer.zero_grad()
    ours = hf_names(trainer.model)
    for name, value in theirs.state_dict().items():  # AdamW's first updates amplify rounding: 5e-6 measured
        assert (ours[name] - value).norm() <= 1e-5 * value.norm(), name
    assert not torch.equal(ours["model.layers.0.mlp.up_proj.weight"], initial), "trained"
    trainer.close()


def test_a_native_family_reads_an_off_flavor_folder_and_trains_as_the_hf_backend(root, tmp_path, trainer_process):
    """`--model.flavor hf`: Qwen3's own model with the shape of the folder's config.json (no flavor
    has it), started from the folder's weights, trains the curve the transformers model of the
    same folder trains (`--model.name hf`), within 1e-5."""
    from titanlite.trainer import Trainer

    folder = hf_folder(tmp_path, "qwen3")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder)).save_pretrained(
        folder
    )
    common = ["--training.mixed_precision_param", "float32", "--training.seq_len", "64", "--training.steps", "3"]
    common += ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_format", "hf"]
    common += ["--metrics.enable_tensorboard", "false", "--metrics.peak_flops", "1e11", "--metrics.log_freq", "1"]
    curves = {}
    for name, model in {"native": ["qwen3", "--model.flavor", "hf"], "hf": ["hf"]}.items():
        argv = ["--config", "debug_model", "--model.hf_assets_path", str(folder), "--model.name", *model, *common]
        argv += ["--job.dump_folder", str(tmp_path / name)]
        plan = plan_run(load_config(argv), 1)
        assert plan.model_args.dim == 64 and plan.spec.name == model[0]
        curves[name] = Trainer(plan).train()
    assert [h["step"] for h in curves["native"]] == [1, 2, 3]
    for ours, theirs in zip(curves["native"], curves["hf"]):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
