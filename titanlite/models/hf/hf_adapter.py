"""The Hugging Face files of a `--model.name hf` model: its state-dict keys are transformers'
own names (models/hf/model.py), so the mapping is the identity, but for a tied head, which
transformers stores once, as the embedding. config.json is the model's folder's, with the
saved dtype. Mixture-of-experts types are refused for now: transformers keeps their experts
stacked in the model and writes them one tensor per expert under older names."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from titanlite.config.dtypes import dtype_name
from titanlite.errors import TitanliteError
from titanlite.model_spec import read_hf_config
from titanlite.models.hf.model import DECODER, HFArgs, read_hf_args
from titanlite.models.hf.moe import EXPERT_COUNTS
from titanlite.models.hf_names import HFAdapterBase


class FolderAdapter(HFAdapterBase):
    """The identity mapping onto the transformers class of the model's own folder (the base's
    answers for the rest: nothing stacked, zero or rotated; a tied head's HF copy ignored)."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ()  # any
    NAMES: ClassVar[dict[str, str]] = {}

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
        return ["experts stored per expert (a mixture-of-experts model)"] if moe else []

    def from_hf(self, state_dict: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
        ours = {name.removeprefix(f"{DECODER}."): value for name, value in state_dict.items()}
        tied = {"lm_head.weight": ours["embed_tokens.weight"]} if args.tie_word_embeddings else {}
        return {**ours, **tied}

    def hf_name(self, key: str) -> str:
        return key if key.startswith("lm_head.") else f"{DECODER}.{key}"

    def tied_to(self, key: str, args: HFArgs) -> str | None:
        return "embed_tokens.weight" if key == "lm_head.weight" and args.tie_word_embeddings else None


folder_adapter = FolderAdapter()
