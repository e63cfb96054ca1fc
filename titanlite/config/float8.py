"""The `[float8]` section (torchtitan's float8 keys; its `[quantize.linear.float8]` table is read as
this one by torchtitan.py) and the checks of `model.converters` and of its keys together;
`sections.JobConfig` holds it, `titanlite/parallel/float8.py` applies it (docs/float8.md)."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.engine import option as _opt
from titanlite.errors import TitanliteError

# torchtitan's model converters titanlite does not have (names as `model.converters` and torchtitan's
# [quantize.*] tables spell them): what each needs
_MXFP8 = "MXFP8 needs an SM100 GPU (Blackwell) and titanlite has no MXFP8 path; float8 is the conversion it has"
REFUSED_CONVERTERS = {
    "mx": _MXFP8,
    "quantize.linear.mx": _MXFP8,
    "quantize.grouped_mm.mx": _MXFP8,
    "quantize.grouped_mm.float8": (
        "float8 grouped GEMM for MoE experts needs an SM90 GPU (torch._scaled_grouped_mm) and titanlite has "
        "no path for it; float8 converts the linear layers and leaves the routed experts in high precision"
    ),
}


CONVERTERS = ("float8", "lora")  # what model.converters may name ([float8] here, [lora] in lora.py)


@dataclass
class Float8:
    """float8 training (torchao) of the linear layers, with model.converters = ["float8"]. torchtitan's
    [float8] keys; its [quantize.linear.float8] section is read as this one."""

    recipe_name: str = _opt(
        "tensorwise",
        "scaling: tensorwise (one scale per tensor; float8 all-gather possible) or rowwise (one per row, "
        "scales rounded to powers of 2, e4m3 gradients: more accurate, no float8 all-gather)",
        choices=("tensorwise", "rowwise"),
    )
    enable_fsdp_float8_all_gather: bool = _opt(
        False, "tensorwise: FSDP gathers the weights cast to float8 (half the bytes of bfloat16) where it shards"
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = _opt(
        False,
        "with enable_fsdp_float8_all_gather: compute every weight's float8 scale in one all-reduce after each "
        "optimizer step instead of one per weight at each gather",
    )
    filter_fqns: list[str] = _opt(
        ["output"],
        "linears whose FQN contains one of these stay in high precision (besides those with a dim not a "
        "multiple of 16); auto_filter_small_kn adds torchao's size rule (too small to gain on an H100)",
    )


def check_float8(converters: list[str], float8: Float8) -> None:
    """`model.converters`' names, and the [float8] keys that only work together."""
    for name in converters:
        if name in REFUSED_CONVERTERS:
            raise TitanliteError(f"model.converters: {name} is not supported: {REFUSED_CONVERTERS[name]}")
        if name not in CONVERTERS:
            raise TitanliteError(
                f"model.converters: unknown converter {name!r} (titanlite has "
                f"{', '.join(CONVERTERS)}; got {converters})"
            )
    if len(set(converters)) < len(converters):
        raise TitanliteError(f"model.converters: a converter named twice (got {converters})")
    if float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        raise TitanliteError(
            f"float8.enable_fsdp_float8_all_gather: only the tensorwise recipe gathers float8 "
            f"(got recipe_name {float8.recipe_name!r})"
        )
    if float8.precompute_float8_dynamic_scale_for_fsdp and not float8.enable_fsdp_float8_all_gather:
        raise TitanliteError(
            "float8.precompute_float8_dynamic_scale_for_fsdp: precomputes the scales of float8 all-gathers, "
            "so it needs float8.enable_fsdp_float8_all_gather = true"
        )
    if any(not name.strip() for name in float8.filter_fqns):
        raise TitanliteError(
            f"float8.filter_fqns: an empty name would filter every linear (got {float8.filter_fqns!r})"
        )
