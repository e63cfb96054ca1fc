"""The model registry: `model.name` in the config -> flavors, builder, parallel plan.

Adding a model is one folder under `models/` and one line here (see docs/adding_a_model.md).
"""

from __future__ import annotations

from titanlite.errors import TitanliteError
from titanlite.model_spec import ModelSpec


def _registry() -> dict[str, ModelSpec]:
    from titanlite.models.deepseek_v3 import deepseek_v3_spec
    from titanlite.models.gpt2 import gpt2_spec
    from titanlite.models.gpt_oss import gpt_oss_spec
    from titanlite.models.hf import hf_spec
    from titanlite.models.llama import llama3_spec
    from titanlite.models.qwen3 import qwen3_spec

    return {spec.name: spec for spec in (llama3_spec, gpt2_spec, qwen3_spec, deepseek_v3_spec, gpt_oss_spec, hf_spec)}


def model_names() -> list[str]:
    """Every registered `model.name`, sorted."""
    return sorted(_registry())


def get_model_spec(name: str, flavor: str | None = None) -> ModelSpec:
    """The spec for `model.name`, checking `model.flavor` when given."""
    registry = _registry()
    if name not in registry:
        raise TitanliteError(f"model.name: unknown model {name!r}; registered: {', '.join(sorted(registry))}")
    spec = registry[name]
    from_folder = spec.folder_args is not None or (flavor == "hf" and spec.hf_adapter is not None)
    if flavor is not None and not from_folder and flavor not in spec.flavors:
        raise TitanliteError(f"model.flavor: {name} has no flavor {flavor!r}; choose one of {', '.join(spec.flavors)}")
    return spec
