"""optimizer.param_groups: the default exempts embeddings, norms and biases from weight decay;
entries parse to one-line errors; the groups reach the optimizer (and a step) as written."""

import pytest
import torch

from titanlite.build import plan_run
from titanlite.config import load_config
from titanlite.config.param_groups import DEFAULT_GROUPS, check_matched, parse_groups
from titanlite.config.sections import Optimizer
from titanlite.errors import TitanliteError
from titanlite.models import get_model_spec
from titanlite.step.optim import build_optimizer, trained_parameters


def named_model(name: str = "qwen3", flavor: str = "debugmodel_moe") -> list[tuple[str, torch.nn.Parameter]]:
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.model_class(spec.args_for(flavor, vocab_size=64))
    for param in model.parameters():
        torch.nn.init.normal_(param, mean=1.0, std=0.1)  # no zeros: decay must show on every weight
    return list(model.named_parameters())


def exempt(name: str, param: torch.Tensor) -> bool:
    """Embeddings (token and position), norms and biases (the only 1-D parameters of these models)."""
    return param.ndim == 1 or "embeddings." in name


MODELS = [("qwen3", "debugmodel_moe"), ("llama3", "debugmodel"), ("gpt2", "debugmodel")]


@pytest.mark.parametrize("model, flavor", MODELS)
def test_the_default_exempts_embeddings_norms_and_biases_and_decays_the_rest(model, flavor):
    named = named_model(model, flavor)
    optimizer = build_optimizer(named, Optimizer(), no_decay=get_model_spec(model).no_decay)
    names = {id(p): n for n, p in named}
    decay = {names[id(p)]: group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert decay.keys() == {n for n, _ in named}
    assert {n for n, wd in decay.items() if wd == 0.0} == {n for n, p in named if exempt(n, p)}
    assert {wd for n, wd in decay.items() if n not in {m for m, p in named if exempt(m, p)}} == {0.1}
    head = "lm_head.weight" if model == "gpt2" else "output.weight"
    assert decay[head] == 0.1  # the head decays (OLMo 2)
    assert any(n.endswith("ln_1.weight") or n.endswith("attention_norm.weight") for n in decay)


# The default groups before each model declared its own no-decay patterns (ModelSpec.no_decay).
FORMER_DEFAULT = "*embeddings.* *norm.weight *ln_*.weight *.bias: weight_decay=0.0"


@pytest.mark.parametrize(
    "model, flavor",
    [*MODELS, ("qwen3", "debugmodel"), ("deepseek_v3", "debugmodel"), ("deepseek_v3", "debugmodel_q_lora")],
)
def test_each_models_no_decay_patterns_group_what_the_former_default_grouped(model, flavor):
    """@no_decay, the model's patterns, puts exactly the parameters the former patterns put in the
    exempt group, with the same settings, and names the group by the model's patterns."""
    named = named_model(model, flavor)
    spec = get_model_spec(model)
    [new], [old] = parse_groups(list(DEFAULT_GROUPS), spec.no_decay), parse_groups([FORMER_DEFAULT])
    assert {n for n, _ in named if new.matches(n)} == {n for n, _ in named if old.matches(n)}
    assert (new.lr_scale, new.weight_decay) == (old.lr_scale, old.weight_decay) == (None, 0.0)
    for muon in (False, True):
        cfg = Optimizer(name="Muon" if muon else "AdamW")
        groups = build_optimizer(named, cfg, no_decay=spec.no_decay).param_groups
        before = build_optimizer(
            named, Optimizer(name=cfg.name, param_groups=[FORMER_DEFAULT]), no_decay=()
        ).param_groups
        assert [[id(p) for p in g["params"]] for g in groups] == [[id(p) for p in g["params"]] for g in before]
        assert [(g["lr"], g["weight_decay"]) for g in groups] == [(g["lr"], g["weight_decay"]) for g in before]
    assert DEFAULT_GROUPS == ("@no_decay: weight_decay=0.0",) and " ".join(new.patterns) == " ".join(spec.no_decay)


def test_a_step_on_zero_gradients_shrinks_only_the_decayed_weights():
    named = named_model("llama3", "debugmodel")
    before = {n: p.detach().clone() for n, p in named}
    optimizer = build_optimizer(named, Optimizer(lr=1e-3), no_decay=get_model_spec("llama3").no_decay)
    for _, param in named:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for name, param in named:
        if exempt(name, param):
            assert torch.equal(param.detach(), before[name]), name
        else:  # decoupled decay alone: w * (1 - lr * weight_decay)
            torch.testing.assert_close(param.detach(), before[name] * (1 - 1e-3 * 0.1), rtol=0, atol=1e-7)
            assert (param.detach().abs() < before[name].abs()).all(), name


def test_first_match_wins_and_settings_left_out_keep_the_optimizers():
    cfg = Optimizer(
        lr=2e-3,
        weight_decay=0.2,
        param_groups=["layers.0.* output.*: lr_scale=0.5", "layers.*: weight_decay=0.01 lr_scale=2"],
    )
    named = named_model("llama3", "debugmodel")
    optimizer = build_optimizer(named, cfg, no_decay=get_model_spec("llama3").no_decay)
    names = {id(p): n for n, p in named}
    seen = {names[id(p)]: (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    assert seen["layers.0.attention.wq.weight"] == (1e-3, 0.2)
    assert seen["output.weight"] == (1e-3, 0.2)
    assert seen["layers.1.feed_forward.w1.weight"] == (4e-3, 0.01)
    assert seen["tok_embeddings.weight"] == (2e-3, 0.2)
    assert [g["group"] for g in optimizer.param_groups] == [
        "layers.0.* output.*: lr_scale=0.5 weight_decay=0.2",
        "layers.*: lr_scale=2 weight_decay=0.01",
        "others: lr_scale=1 weight_decay=0.2",
    ]


def test_the_resolved_config_shows_the_default_groups():
    cfg = load_config([])
    assert cfg.optimizer.param_groups == list(DEFAULT_GROUPS)
    assert parse_groups(cfg.optimizer.param_groups)[0].weight_decay == 0.0


@pytest.mark.parametrize(
    "entry, message",
    [
        ("layers.*", "has no ':'"),
        (": weight_decay=0", "names no pattern"),
        ("layers.*:", "sets neither lr_scale nor weight_decay"),
        ("layers.*: lr=2", "has 'lr=2': settings are lr_scale=NUMBER and weight_decay=NUMBER"),
        ("layers.*: weight_decay=abc", "has weight_decay='abc', not a number"),
        ("layers.*: lr_scale=-1", "has lr_scale=-1: must be a finite number >= 0"),
        ("layers.*: lr_scale=nan", "must be a finite number >= 0"),
        ("@norms: weight_decay=0", "has '@norms': the one named pattern is @no_decay"),
        ("layers.*: lr_scale=0.5 lr_scale=2", "sets lr_scale twice"),
        ("layers.*: weight_decay=0 lr_scale=1 weight_decay=0", "sets weight_decay twice"),
    ],
)
def test_bad_entries_are_one_line_naming_the_field(entry, message):
    with pytest.raises(TitanliteError) as error:
        load_config(["--optimizer.param_groups", f'["{entry}"]'])
    text = str(error.value)
    assert text.startswith(f"optimizer.param_groups: entry {entry!r}") and message in text and "\n" not in text


def test_a_toml_file_sets_the_groups(tmp_path):
    path = tmp_path / "groups.toml"
    path.write_text('[optimizer]\nparam_groups = ["*.wq.weight: lr_scale=0.1", "*norm.weight: weight_decay=0"]\n')
    assert load_config(["--config", str(path)]).optimizer.param_groups == [
        "*.wq.weight: lr_scale=0.1",
        "*norm.weight: weight_decay=0",
    ]


def test_an_entry_that_is_not_a_list_of_strings_is_one_line(tmp_path):
    path = tmp_path / "groups.toml"
    path.write_text('[optimizer]\nparam_groups = [{pattern = "x"}]\n')
    with pytest.raises(TitanliteError, match="optimizer.param_groups"):
        load_config(["--config", str(path)])


def test_wrapped_blocks_keep_the_models_names():
    """Activation checkpointing and torch.compile wrap the blocks; the groups see the model's names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_class(spec.args_for("debugmodel", vocab_size=64))
    plain = [name for name, _ in model.named_parameters()]
    model.layers["0"] = checkpoint_wrapper(model.layers["0"])
    model.layers["1"] = torch.compile(model.layers["1"])
    named = trained_parameters(model)
    assert [name for name, _ in named] == plain
    optimizer = build_optimizer(named, Optimizer(), no_decay=spec.no_decay)
    exempt = next(g for g in optimizer.param_groups if g["weight_decay"] == 0.0)
    assert {id(p) for p in exempt["params"]} == {id(p) for n, p in named if "norm" in n or "embeddings" in n}


def planned(*argv: str, world_size: int = 1):
    return plan_run(load_config(["--config", "debug_model", *argv]), world_size, vocab_size=64)


def test_a_pattern_that_matches_no_parameter_of_the_model_is_one_line_naming_it_when_planned():
    for entry, pattern, closest in (
        ("nothing.*: lr_scale=0.5", "nothing.*", None),
        ("layers.*.atention.wq.weight output.*: lr_scale=0.5", "layers.*.atention.wq.weight", ".attention.wq.weight"),
    ):
        with pytest.raises(TitanliteError) as error:
            planned("--optimizer.param_groups", f'["{entry}"]')
        text = str(error.value)
        assert text.startswith(f"optimizer.param_groups: entry {entry!r} has {pattern!r}, which matches no"), text
        assert "\n" not in text and (closest is None or closest in text.split("(closest: ")[1]), text
    # @no_decay, the model's own patterns, is not checked: one that matches nothing here is no error
    check_matched(["@no_decay: weight_decay=0", "*norm.weight: lr_scale=2"], ["norm.weight"])


def test_a_pattern_is_matched_against_the_whole_model_not_one_pipeline_stage():
    """The first of two stages holds no output head; the pattern is checked on the whole model."""
    plan = planned(
        "--optimizer.param_groups",
        '["output.*: lr_scale=0.5"]',
        "--parallelism.pipeline_parallel_degree",
        "2",
        world_size=2,
    )
    assert [stage.last for stage in plan.pipeline.stages] == [False, True]
