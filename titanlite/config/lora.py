"""The `[lora]` section: low-rank adapters trained on a frozen model, with model.converters =
["lora"] (`titanlite/parallel/lora.py` applies it; docs/fine_tuning.md). The keys are PEFT's
`LoraConfig` ones (r is `rank`, lora_alpha `alpha`), so an exported adapter folder reads the same."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.engine import option as _opt
from titanlite.errors import TitanliteError


@dataclass
class LoRA:
    """LoRA (Hu et al. 2021) as PEFT trains it: each target linear computes W x + (alpha / rank) B A x
    with W frozen, A (rank x in) and B (out x rank) trained (B starts at zero)."""

    rank: int = _opt(8, "the adapters' inner dimension (PEFT's r)", gt=0)
    alpha: float = _opt(16.0, "the adapters' scale is alpha / rank (PEFT's lora_alpha)", gt=0)
    dropout: float = _opt(0.0, "dropout on the adapters' input (PEFT's lora_dropout)", ge=0, lt=1)
    target_modules: list[str] = _opt(
        ["wq", "wv"],
        "the linears that get adapters, by their last name in the model (wq, wk, wv, wo, w1, w2, w3; the hf "
        "model's own, q_proj, v_proj, ...), or a dotted end of their name (feed_forward.w2)",
    )
    save: str = _opt(
        "adapters",
        "adapters: checkpoints hold the adapters (the frozen weights come from checkpoint.initial_load_path, or "
        "the seed's init, on resume) and last_save_in_hf writes a PEFT adapter folder; merged: checkpoints hold "
        "every weight and last_save_in_hf writes the model with the adapters merged into its weights",
        choices=("adapters", "merged"),
    )


def check_lora(converters: list[str], lora: LoRA) -> None:
    """The keys of [lora] that only work together, and with the other converters."""
    if "lora" not in converters:
        return
    if "float8" in converters:
        raise TitanliteError("model.converters: lora and float8 together are not supported (float8 swaps the linears)")
    if not lora.target_modules or any(not name.strip() for name in lora.target_modules):
        raise TitanliteError(
            f"lora.target_modules: name at least one linear, no empty names (got {lora.target_modules})"
        )
