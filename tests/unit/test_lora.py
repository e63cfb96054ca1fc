"""LoRA (`model.converters = ["lora"]`, titanlite/parallel/lora.py) against Hugging Face's PEFT: the
same frozen weights, adapters and batches train the same losses and adapters in titanlite's trainer
and in PEFT's LoRA model under a plain torch loop; an exported adapter folder loads with
`peft.PeftModel.from_pretrained` and a merged folder with transformers, both giving titanlite's
logits. (The parallel layouts train like one process in tests/runs/test_parallel_equivalence*.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.hf_models import hf_folder
from tests.unit.test_hf_backend import trainer_process  # noqa: F401  (a fixture)
from titanlite.build import plan_run
from titanlite.config.load import load_config
from titanlite.errors import TitanliteError
from titanlite.parallel.lora import LoRALinear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = {"wq": "q_proj", "wv": "v_proj", "wo": "o_proj", "w2": "down_proj"}


def saved_folder(root, model_type: str):
    """A tiny transformers model of `model_type` with seeded weights, saved with its tokenizer."""
    folder = hf_folder(root, model_type)
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def lora_argv(
    folder, tmp_path, *extra: str, family: str = "qwen3", targets: str = ",".join(TARGETS), steps: int = 3
) -> list[str]:
    argv = ["--config", "debug_model", "--model.name", family, "--model.flavor", "hf"]
    argv += ["--model.hf_assets_path", str(folder), "--model.converters", "lora"]
    argv += ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_format", "hf"]
    argv += ["--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", targets]
    argv += ["--training.mixed_precision_param", "float32", "--training.seq_len", "64", "--training.steps", str(steps)]
    argv += ["--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3", "--metrics.enable_tensorboard", "false"]
    return [*argv, "--metrics.peak_flops", "1e11", "--job.dump_folder", str(tmp_path), *extra]


def adapters(model: torch.nn.Module, hf_adapter) -> dict[str, torch.Tensor]:
    """titanlite's adapters under PEFT's names (Qwen3's rows are HF's: no permutation)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            hf = hf_adapter.hf_name(f"{name}.weight").removesuffix(".weight")
            found[f"base_model.model.{hf}.lora_A.default.weight"] = module.lora_a
            found[f"base_model.model.{hf}.lora_B.default.weight"] = module.lora_b
    return found


def test_three_steps_equal_peft_lora_on_the_transformers_model(tmp_path, trainer_process):
    """The trainer at one process (LoRA on q, v, o and down projections, rank 4, alpha 8) against
    PEFT's LoRA of the same rank, alpha and targets on transformers' Qwen3, from the same folder,
    with titanlite's initial A (B is zero in both), under torch's AdamW (the adapters' weight
    decay), clip_grad_norm_ and F.cross_entropy on the same batches: the loss of each step within
    1e-6 and every adapter within 1e-5 of its norm after 3 steps; the base weights unchanged."""
    from titanlite.step.optim import lr_factor
    from titanlite.trainer import Trainer

    folder = saved_folder(tmp_path, "qwen3")
    trainer = Trainer(plan_run(load_config(lora_argv(folder, tmp_path / "run")), 1))
    trainer.run.checkpoint.load(trainer.run.state)  # the folder's weights, as train() starts
    cfg = trainer.plan.cfg
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(TARGETS.values()))
    theirs = peft.get_peft_model(base, config)
    ours = adapters(trainer.model, trainer.plan.spec.hf_adapter)
    assert len(ours) == 2 * 4 * 2  # 4 linears of 2 layers
    theirs.load_state_dict({k: v.detach() for k, v in ours.items()}, strict=False)
    trained = [p for p in theirs.parameters() if p.requires_grad]
    assert len(trained) == len(ours)
    frozen_before = theirs.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    optimizer = torch.optim.AdamW(
        trained,
        lr=cfg.optimizer.lr,
        betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
        eps=cfg.optimizer.eps,
        weight_decay=cfg.optimizer.weight_decay,
        fused=True,
    )
    batches = iter(trainer.data)
    for step in range(1, 4):
        inputs, labels = next(batches)
        loss, _, _ = trainer.train_step([(inputs, labels)])
        for group in optimizer.param_groups:
            group["lr"] = cfg.optimizer.lr * lr_factor(step, 3, 2, None, "linear", 0.0)
        logits = theirs(input_ids=inputs).logits
        reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        assert loss.item() == pytest.approx(reference.item(), rel=1e-6), f"step {step}"
        reference.backward()
        torch.nn.utils.clip_grad_norm_(trained, cfg.training.max_norm)
        optimizer.step()
        optimizer.zero_grad()
    state = theirs.state_dict()
    for name, value in adapters(trainer.model, trainer.plan.spec.hf_adapter).items():
        assert (value.detach() - state[name]).norm() <= 1e-5 * state[name].norm(), name
    assert state["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"].abs().sum() > 0, "trained"
    wq = trainer.model.layers["0"].attention.wq
    assert torch.equal(wq.weight, frozen_before) and not wq.weight.requires_grad
    trainer.close()


def test_a_target_that_matches_no_linear_is_refused_with_the_models_linears(tmp_path):
    argv = ["--config", "debug_model", "--model.converters", "lora", "--lora.target_modules", "q_proj"]
    with pytest.raises(TitanliteError) as refused:
        plan_run(load_config(argv), 1)
    assert str(refused.value) == (
        "lora.target_modules: ['q_proj'] match no linear layer of the model (its linears: output, w1, w2, w3, "
        "wk, wo, wq, wv)"
    )
    with pytest.raises(TitanliteError, match=r"^model.converters: lora and float8 together are not supported"):
        load_config(["--config", "debug_model", "--model.converters", "lora,float8"])


@pytest.mark.parametrize("save", ["adapters", "merged"])
def test_the_exported_adapters_load_with_peft_and_the_merged_folder_with_transformers(save, tmp_path, trainer_process):
    """Llama (its q and k rows permuted on the way to HF's layout, the adapters' B with them)
    trained 2 steps with adapters on every attention projection, then `last_save_in_hf`: PEFT's
    `PeftModel.from_pretrained` on the transformers base model (adapters), or transformers alone
    (merged), gives titanlite's logits within 1e-5."""
    from titanlite.trainer import Trainer

    folder = saved_folder(tmp_path, "llama")
    argv = lora_argv(folder, tmp_path / "run", family="llama3", targets="wq,wk,wv,wo", steps=2)
    argv += ["--checkpoint.enable_checkpoint", "true", "--checkpoint.last_save_in_hf", "true"]
    trainer = Trainer(plan_run(load_config([*argv, "--lora.save", save]), 1))
    trainer.train()
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = trainer.model(tokens)
    exported = tmp_path / "run" / "checkpoint" / "step-2-hf"
    if save == "adapters":
        assert sorted(p.name for p in exported.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        theirs = peft.PeftModel.from_pretrained(base, exported)
        assert sorted(theirs.peft_config["default"].target_modules) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    else:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
        assert not any("lora" in name for name in theirs.state_dict())
    with torch.no_grad():
        logits = theirs(input_ids=tokens).logits
    assert (logits - ours).abs().max() <= 1e-5 * ours.abs().max()
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert (plain(input_ids=tokens).logits - ours).abs().max() > 1e-3, "the adapters changed the model"
    trainer.close()


def test_a_checkpoint_holds_the_adapters_only_and_resumes_exactly_on_the_folders_weights(tmp_path, trainer_process):
    """lora.save = adapters: step 2's checkpoint holds the adapters and their AdamW state, not
    the frozen weights; a run resumed from it reloads those from checkpoint.initial_load_path
    (the HF folder) and logs steps 3-4 exactly as the uninterrupted run did."""
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    from titanlite.trainer import Trainer

    folder = saved_folder(tmp_path, "qwen3")
    common = ["--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2", "--lr_scheduler.decay_ratio", "0"]
    common += ["--metrics.log_freq", "1"]
    straight = Trainer(plan_run(load_config(lora_argv(folder, tmp_path / "straight", *common, steps=4)), 1)).train()
    saved = tmp_path / "straight" / "checkpoint" / "step-2"
    keys = list(FileSystemReader(saved).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(k.endswith((".lora_a", ".lora_b")) for k in model_keys), model_keys
    assert len(model_keys) == 2 * 4 * 2  # A and B of 4 linears in 2 layers
    state_keys = [k for k in keys if k.startswith("optimizer.state.")]
    assert state_keys and all(".lora_" in k for k in state_keys), state_keys
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoint" / "step-2")
    resumed = Trainer(plan_run(load_config(lora_argv(folder, tmp_path / "resumed", *common, steps=4)), 1)).train()
    assert [h["step"] for h in resumed] == [3, 4]
    assert [(h["loss"], h["grad_norm"]) for h in resumed] == [(h["loss"], h["grad_norm"]) for h in straight[2:]]


def test_dropout_drops_the_adapters_input_in_training_only_and_a_dotted_target_picks_one_linear():
    """lora.dropout = 0.5: in train mode the adapters see a dropped input (another output than
    without dropout), in eval mode the same; `feed_forward.w2` converts w2 alone, not attention."""
    from titanlite.config.lora import LoRA
    from titanlite.models.init import init_adapters
    from titanlite.parallel.lora import convert

    model = torch.nn.Module()
    model.feed_forward = torch.nn.Module()
    model.feed_forward.w2 = torch.nn.Linear(16, 16)
    model.attention = torch.nn.Module()
    model.attention.w2 = torch.nn.Linear(16, 16)
    assert convert(model, LoRA(rank=4, alpha=4.0, dropout=0.5, target_modules=["feed_forward.w2"])) == [
        "feed_forward.w2"
    ]
    assert type(model.attention.w2) is torch.nn.Linear and not model.attention.w2.weight.requires_grad
    init_adapters(model, seed=0)
    adapted = model.feed_forward.w2
    torch.nn.init.normal_(adapted.lora_b)  # B = 0 would hide the adapters' input
    x = torch.randn(8, 16)
    undropped = torch.nn.functional.linear(x, adapted.weight, adapted.bias) + adapted.scale * (
        x @ adapted.lora_a.T @ adapted.lora_b.T
    )
    torch.manual_seed(0)
    assert not torch.allclose(adapted.train()(x), undropped)
    torch.testing.assert_close(adapted.eval()(x), undropped)


def test_bad_lora_settings_are_one_line():
    with pytest.raises(TitanliteError, match=r"^lora.rank: "):
        load_config(["--config", "debug_model", "--model.converters", "lora", "--lora.rank", "0"])
    with pytest.raises(TitanliteError, match=r"^model.converters: unknown converter 'qlora'"):
        load_config(["--config", "debug_model", "--model.converters", "qlora"])
    gpt2 = ["--config", "debug_model", "--model.name", "gpt2", "--model.converters", "lora"]
    with pytest.raises(TitanliteError, match=r"^checkpoint.last_save_in_hf: model gpt2 "):
        plan_run(load_config([*gpt2, "--lora.target_modules", "c_attn", "--checkpoint.last_save_in_hf", "true"]), 1)
