"""The Hugging Face files of a `--model.name hf` model: its state-dict keys are transformers'
own names under the decoder's prefix (models/hf/model.py), but for a tied head, which
transformers stores once, as the embedding, and titanlite's MoE layer where it replaced a
sparse block (models/hf/moe.py): its stacked experts are one tensor per expert in the files,
`mlp.experts.E.gate_proj.weight` (up_proj, down_proj), as transformers 5 writes and reads
Qwen3-MoE, OLMoE and DeepSeek-V2 (`MoEHFAdapterBase`), its router `mlp.gate`, its shared
experts transformers' MLP names. Mixtral's files use older names (`block_sparse_moe`, w1-w3)
and MoE blocks transformers keeps are stored as it keeps them: both refused for export.
config.json is the model's folder's, with the saved dtype."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from titanlite.config.dtypes import dtype_name
from titanlite.errors import TitanliteError
from titanlite.model_spec import read_hf_config
from titanlite.models.hf.model import DECODER, HFArgs, read_hf_args
from titanlite.models.hf.moe import EXPERT_COUNTS
from titanlite.models.hf_names import SWIGLU, MoEHFAdapterBase

# Our names inside a swapped MoE layer -> transformers' (the stacked experts aside).
MOE_NAMES = {"mlp.router.gate.weight": "mlp.gate.weight"} | {
    f"mlp.shared_experts.{ours}.weight": f"mlp.shared_experts.{theirs}.weight" for ours, theirs in SWIGLU.items()
}
MOE_OURS = {theirs: ours for ours, theirs in MOE_NAMES.items()}


class FolderAdapter(MoEHFAdapterBase):
    """Transformers' names of the model's own folder (the base's answers for the rest: nothing
    zero or rotated; a tied head's HF copy ignored; the experts one tensor per expert)."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ()  # any
    NAMES: ClassVar[dict[str, str]] = {}
    EXPERT_BIAS_IN_HF: ClassVar[bool] = False  # the swapped layers have none
    FEED_FORWARD: ClassVar[str] = "mlp"
    HEAD: ClassVar[str] = "lm_head.weight"
    EMBEDDING: ClassVar[str] = "embed_tokens.weight"

    def hf_config(self, args: HFArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        config = read_hf_config(args.folder)
        return {**config, "dtype": dtype_name(dtype), "torch_dtype": dtype_name(dtype)}

    def check_hf_config(self, config: dict[str, Any], args: HFArgs) -> list[str]:
        ours = self.hf_config(args)
        keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")
        return [
            f"{key} {config.get(key)} (this model: {ours.get(key)})" for key in keys if config.get(key) != ours.get(key)
        ]

    def args_from_hf_config(self, config: dict[str, Any], base: HFArgs | None = None) -> HFArgs:
        if base is None:  # a bare config.json has no folder to build the transformers class from
            raise TitanliteError("model hf: its shape is read from model.hf_assets_path, not from a config alone")
        return read_hf_args(base.folder)

    def hf_export_problems(self, args: HFArgs) -> list[str]:
        moe = any(self.hf_config(args).get(key) for key in EXPERT_COUNTS)
        if moe and (args.moe is None or args.model_type == "mixtral"):
            return [f"{args.model_type}'s experts under names titanlite does not write"]
        return []

    def our_name(self, name: str) -> str:
        return _suffix_renamed(name.removeprefix(f"{DECODER}."), MOE_OURS)

    def hf_name(self, key: str) -> str:
        return key if key.startswith("lm_head.") else f"{DECODER}.{_suffix_renamed(key, MOE_NAMES)}"


def _suffix_renamed(key: str, table: dict[str, str]) -> str:
    """`key` with the first of `table`'s suffixes it ends with replaced by its value."""
    suffix = next((end for end in table if key.endswith(end)), None)
    return key if suffix is None else key.removesuffix(suffix) + table[suffix]


folder_adapter = FolderAdapter()
