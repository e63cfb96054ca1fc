"""Muon (step/muon.py) on one process: the hidden matrices' update is torch.optim.Muon's (each
routed expert of a stacked weight as its own matrix), the rest is AdamW's, every option
reaches the update, and bad values are one line. The distributed exchange is checked against
one process in tests/runs/test_parallel_equivalence.py (its Muon layouts)."""

import pytest
import torch

from titanlite.config import load_config
from titanlite.config.sections import Optimizer
from titanlite.errors import TitanliteError
from titanlite.models import get_model_spec
from titanlite.step.optim import build_optimizer

NO_GROUPS: list[str] = []


def matrices(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.attention.wq.weight": torch.randn(16, 8, generator=g),  # tall
        "layers.0.feed_forward.w2.weight": torch.randn(8, 24, generator=g),  # wide
        "layers.0.feed_forward.experts.w1": torch.randn(3, 12, 8, generator=g),  # 3 experts
    }


OPTIONS = [
    {},
    {"muon_nesterov": False, "muon_momentum": 0.8, "muon_newton_schulz_steps": 3},
    {"muon_adjust_lr": "match_rms_adamw", "muon_lr": 0.05, "weight_decay": 0.3},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_the_matrices_update_as_torch_muon_updates_them(options):
    cfg = Optimizer(name="Muon", lr=0.02, param_groups=NO_GROUPS, **options)
    ours = {name: torch.nn.Parameter(value.clone()) for name, value in matrices().items()}
    theirs = {}
    for name, value in matrices().items():  # a stacked expert weight: one matrix per expert
        for index, matrix in enumerate(value if value.ndim == 3 else [value]):
            theirs[(name, index)] = torch.nn.Parameter(matrix.clone())
    optimizer = build_optimizer(list(ours.items()), cfg, no_decay=())
    reference = torch.optim.Muon(
        list(theirs.values()),
        lr=cfg.muon_lr or cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_newton_schulz_steps,
        adjust_lr_fn=cfg.muon_adjust_lr,
    )
    for step in range(3):
        for name, grad in matrices(seed=10 + step).items():
            ours[name].grad = grad
            for index, matrix in enumerate(grad if grad.ndim == 3 else [grad]):
                theirs[(name, index)].grad = matrix.clone()
        optimizer.step()
        reference.step()
        for (name, index), param in theirs.items():
            mine = ours[name].detach()
            # bit for bit: step/muon.py writes torch's Newton-Schulz with public ops, in its order and dtype
            torch.testing.assert_close(mine[index] if mine.ndim == 3 else mine, param.detach(), rtol=0, atol=0)
    assert optimizer.last_owned == 1 + 1 + 3  # one process orthogonalizes every matrix itself
    moved = {name: (ours[name].detach() - value).abs().max().item() for name, value in matrices().items()}
    assert all(change > 1e-3 for change in moved.values()), moved


def test_embeddings_head_norms_and_biases_update_as_torch_adamw():
    g = torch.Generator().manual_seed(1)
    values = {
        "tok_embeddings.weight": torch.randn(32, 8, generator=g),
        "output.weight": torch.randn(32, 8, generator=g),
        "layers.0.attention_norm.weight": torch.randn(8, generator=g),
        "layers.0.attention.wq.bias": torch.randn(8, generator=g),
    }
    cfg = Optimizer(name="Muon", lr=1e-2, muon_lr=0.5, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.2)
    ours = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
    optimizer = build_optimizer(list(ours.items()), cfg, no_decay=("tok_embeddings.*", "*norm.weight", "*.bias"))
    assert {g["algorithm"] for g in optimizer.param_groups} == {"adamw"}
    theirs = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
    exempt = [
        theirs["tok_embeddings.weight"],
        theirs["layers.0.attention_norm.weight"],
        theirs["layers.0.attention.wq.bias"],
    ]
    reference = torch.optim.AdamW(
        [{"params": exempt, "weight_decay": 0.0}, {"params": [theirs["output.weight"]]}],
        lr=1e-2,
        betas=(0.8, 0.9),
        eps=1e-6,
        weight_decay=0.2,
        foreach=False,
    )
    for step in range(3):
        for name in values:
            ours[name].grad = torch.randn(values[name].shape, generator=torch.Generator().manual_seed(step))
            theirs[name].grad = ours[name].grad.clone()
        optimizer.step()
        reference.step()
    for name in values:
        torch.testing.assert_close(ours[name].detach(), theirs[name].detach(), rtol=0, atol=0)  # torch's AdamW itself


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest_of_a_moe_model():
    spec = get_model_spec("qwen3")
    with torch.device("meta"):
        model = spec.model_class(spec.args_for("debugmodel_moe", vocab_size=64))
    named = list(model.named_parameters())
    optimizer = build_optimizer(named, Optimizer(name="Muon"), no_decay=spec.no_decay)
    names = {id(p): n for n, p in named}
    muon = {names[id(p)] for g in optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if g["algorithm"] == "adamw" for p in g["params"]}
    assert muon | adamw == set(names.values()) and not muon & adamw
    assert adamw == {n for n, p in named if p.ndim == 1 or n in ("tok_embeddings.weight", "output.weight")}
    assert any(".experts." in n for n in muon) and any(".router.gate." in n for n in muon)
    assert any(".attention.wq." in n for n in muon) and any(".feed_forward.experts.w2" in n for n in muon)


def test_gpt2s_embeddings_and_head_take_adamw():
    spec = get_model_spec("gpt2")
    with torch.device("meta"):
        model = spec.model_class(spec.args_for("debugmodel", vocab_size=64))
    named = list(model.named_parameters())
    optimizer = build_optimizer(named, Optimizer(name="Muon"), no_decay=spec.no_decay)
    names = {id(p): n for n, p in named}
    adamw = {names[id(p)] for g in optimizer.param_groups if g["algorithm"] == "adamw" for p in g["params"]}
    assert {"embeddings.wte.weight", "embeddings.wpe.weight", "lm_head.weight", "ln_f.weight"} <= adamw
    assert all(p.ndim == 1 for n, p in named if n in adamw and n.startswith("layers."))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("name", "SGD", "optimizer.name"),
        ("muon_momentum", "1.0", "optimizer.muon_momentum"),
        ("muon_newton_schulz_steps", "0", "optimizer.muon_newton_schulz_steps"),
        ("muon_adjust_lr", "spectral", "optimizer.muon_adjust_lr"),
        ("muon_lr", "0", "optimizer.muon_lr"),
        ("muon_nesterov", "maybe", "optimizer.muon_nesterov"),
    ],
)
def test_bad_muon_values_are_one_line_naming_the_key(key, value, message):
    with pytest.raises(TitanliteError) as error:
        load_config([f"--optimizer.{key}", value])
    assert message in str(error.value) and "\n" not in str(error.value)
