"""float8 training through torchao (`model.converters = ["float8"]`): what runs on this CPU."""

import copy
import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from titanlite.config import Float8, load_config
from titanlite.errors import TitanliteError
from titanlite.models.llama import Llama, llama3_flavors
from titanlite.parallel.float8 import convert_to_float8, float8_config, plain_tensors, torchao_float8
from titanlite.parallel.parallelize import parallelize


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_emulates_float8_training_on_cpu(recipe):
    """The feasibility check of issue 39 item 3: torchao 0.18's Float8Linear, emulated, runs
    forward and backward on this CPU, and its output and gradients are the float32 ones up to
    float8's rounding (e4m3 keeps 3 mantissa bits: 2**-4 relative per element at most)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 32, bias=False))
    reference = copy.deepcopy(model)
    float8 = torchao_float8()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    float8.convert_to_float8_training(model, config=config)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "ReLU", "Float8Linear"]
    x = torch.randn(16, 64)
    out, expected = model(x), reference(x)
    out.square().sum().backward()
    expected.square().sum().backward()

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    assert 0 < relative(out, expected) < 0.1
    for converted, plain in zip(model[::2], reference[::2]):
        assert 0 < relative(converted.weight.grad, plain.weight.grad) < 0.25


# --- the conversion: which linears, on the debug model ------------------------------------------

BLOCK_LINEARS = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"] + [
    f"feed_forward.w{i}" for i in (1, 2, 3)
]


def float8_modules(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]


def debug_model() -> nn.Module:
    with torch.device("meta"):
        return Llama(dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=4096))


def test_parallelize_converts_every_block_linear_and_leaves_the_filtered_head():
    """torchtitan's default filter_fqns = ["output"]: the head stays high precision (its
    logits feed the loss); every other linear of the debug model (dims 256, 128, 768) is a
    multiple of 16 and converts."""
    model = parallelize(debug_model(), None, float8=Float8())
    assert float8_modules(model) == [f"layers.{i}.{name}" for i in range(6) for name in BLOCK_LINEARS]
    assert type(model.output) is nn.Linear


def test_filter_fqns_match_by_substring_and_dims_must_be_multiples_of_16():
    model = debug_model()
    assert convert_to_float8(
        model, Float8(filter_fqns=["output", "attention"]), device_type="cpu", fsdp=False, compile=False
    ) == [f"layers.{i}.feed_forward.w{j}" for i in range(6) for j in (1, 2, 3)]
    odd = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(40, 64))
    assert convert_to_float8(odd, Float8(filter_fqns=[]), device_type="cpu", fsdp=False, compile=False) == ["0"]


def test_auto_filter_small_kn_leaves_linears_too_small_to_gain():
    """torchao's size rule (H100 timings): the debug model's 256-wide linears gain nothing."""
    settings = Float8(filter_fqns=["output", "auto_filter_small_kn"])
    assert convert_to_float8(debug_model(), settings, device_type="cpu", fsdp=False, compile=False) == []
    big = nn.Sequential(nn.Linear(4096, 4096, bias=False, device="meta"))
    assert convert_to_float8(big, settings, device_type="cpu", fsdp=False, compile=False) == ["0"]


@pytest.mark.parametrize("recipe, granularity", [("tensorwise", "tensorwise"), ("rowwise", "axiswise")])
def test_the_recipe_and_the_device_pick_torchaos_config(recipe, granularity):
    """Emulated here (no float8 matmuls on a CPU); float8 all-gather only where FSDP shards."""
    config = float8_config(Float8(recipe_name=recipe), fsdp=True, emulate=True)
    assert config.emulate and config.cast_config_weight.scaling_granularity.value == granularity
    gathered = float8_config(Float8(enable_fsdp_float8_all_gather=True), fsdp=True, emulate=False)
    assert gathered.enable_fsdp_float8_all_gather and not gathered.emulate
    assert not float8_config(
        Float8(enable_fsdp_float8_all_gather=True), fsdp=False, emulate=True
    ).enable_fsdp_float8_all_gather


# --- the config: model.converters and [float8], torchtitan's [quantize.linear.float8] ---------------


def loaded(*argv: str, notices: list[str] | None = None):
    return load_config(["--config", "debug_model", *argv], notices)


def test_converters_and_the_float8_keys_in_both_spellings(tmp_path):
    cfg = loaded("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise")
    assert cfg.model.converters == ["float8"] and cfg.float8.recipe_name == "rowwise"
    path = tmp_path / "torchtitan.toml"
    path.write_text(
        '[model]\nconverters = ["float8"]\n[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n'
        'precompute_float8_dynamic_scale_for_fsdp = true\nfilter_fqns = ["output", "router.gate"]\nemulate = true\n'
        '[quantize.grouped_mm.float8]\nfqns = ["experts"]\n'
    )
    notices: list[str] = []
    cfg = load_config(["--config", str(path)], notices)
    assert cfg.model.converters == ["float8"]
    assert (cfg.float8.enable_fsdp_float8_all_gather, cfg.float8.precompute_float8_dynamic_scale_for_fsdp) == (
        True,
        True,
    )
    assert cfg.float8.filter_fqns == ["output", "router.gate"]
    assert [n.split(" ")[0] for n in notices] == [
        "quantize.linear.float8.emulate",
        "[quantize.grouped_mm.float8]",
        "optimizer.param_groups",
        "model.flavor",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.converters", "fp4"], "model.converters: unknown converter 'fp4' (titanlite has float8"),
        (["--model.converters", "mx"], "model.converters: mx is not supported: MXFP8 needs an SM100 GPU (Blackwell)"),
        (
            ["--model.converters", "float8,quantize.grouped_mm.float8"],
            "model.converters: quantize.grouped_mm.float8 is not supported: float8 grouped GEMM for MoE experts "
            "needs an SM90 GPU",
        ),
        (["--model.converters", "float8,float8"], "model.converters: a converter named twice"),
        (
            ["--float8.recipe_name", "blockwise"],
            "float8.recipe_name: must be one of tensorwise, rowwise (got 'blockwise')",
        ),
        (
            ["--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
            "float8.enable_fsdp_float8_all_gather: only the tensorwise recipe gathers float8 "
            "(got recipe_name 'rowwise')",
        ),
        (
            ["--float8.precompute_float8_dynamic_scale_for_fsdp"],
            "float8.precompute_float8_dynamic_scale_for_fsdp: precomputes the scales of float8 all-gathers, so it "
            "needs float8.enable_fsdp_float8_all_gather = true",
        ),
        (["--float8.filter_fqns", '["output", " "]'], "float8.filter_fqns: an empty name would filter every linear"),
    ],
)
def test_bad_values_are_one_line(argv, message):
    with pytest.raises(TitanliteError) as error:
        loaded(*argv)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[float8]\nfilter_fqns = "output"\n', "float8.filter_fqns: expected a list of strings, got 'output'"),
        ('[quantize.linear.float8]\nrecipe = "rowwise"\n', "unknown key float8.recipe "),
        ("[quantize.linear.fp4]\nfilter_fqns = []\n", "unknown section [quantize.linear.fp4]"),
    ],
)
def test_bad_tables_are_one_line(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(TitanliteError) as error:
        load_config(["--config", str(path)])
    assert str(error.value).startswith(message), str(error.value)


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_on_gloo_a_unit_of_float8_weights_alone_is_refused_and_checkpoints_hold_plain_tensors(one_rank_world):
    """gloo cannot all-gather float8: a unit must hold another parameter (a bias here), so FSDP
    packs its gather into bytes. The state dict a checkpoint saves holds plain tensors sharing
    the weights' storage, not torchao's subclass (which torch.load refuses without torchao)."""
    gathered = Float8(filter_fqns=[], enable_fsdp_float8_all_gather=True)
    mesh = init_device_mesh("cpu", (1,))
    alone = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False))
    with pytest.raises(
        TitanliteError, match=r"^float8.enable_fsdp_float8_all_gather: FSDP unit 0 holds float8 linears"
    ):
        parallelize(alone, mesh, fsdp_modules=[nn.Linear], float8=gathered)
    model = parallelize(
        nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), mesh, fsdp_modules=[nn.Linear], float8=gathered
    )
    assert type(model[0].weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
    state = plain_tensors(model.state_dict())
    assert {type(t._local_tensor) for t in state.values()} == {torch.Tensor}
    assert state["0.weight"]._local_tensor.data_ptr() == model[0].weight._local_tensor._tensor.data_ptr()


def test_a_missing_torchao_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what `import` meets where torchao is not installed
    with pytest.raises(
        TitanliteError, match=r'^model.converters: float8 needs torchao \(pip install "titanlite\[float8\]"'
    ):
        parallelize(debug_model(), None, float8=Float8())
