"""`model.name = "hf"`: the transformers causal LM whose folder `model.hf_assets_path` names
(its config.json; the tokenizer files beside it), trained with titanlite's parallelisms. The
model's shape comes from that folder, not from a flavor (`ModelSpec.folder_args`)."""

from titanlite.models.hf.hf_adapter import folder_adapter
from titanlite.models.hf.model import HFArgs, HFCausalLM, read_hf_args
from titanlite.models.hf.parallelize import apply_tp, tp_problems
from titanlite.model_spec import Capabilities, ModelSpec, decoder_flops_per_token

hf_spec = ModelSpec(
    name="hf",
    model_class=HFCausalLM,
    flavors={},
    folder_args=read_hf_args,
    hf_adapter=folder_adapter,
    apply_tp=apply_tp,
    tp_problems=tp_problems,
    flops_per_token=decoder_flops_per_token,
    no_decay=("*embed_tokens.*", "*norm.weight", "*.bias"),
    capabilities=Capabilities(pipeline_split=True, context_parallel=True, document_mask=True, moe=True),
)

__all__ = ["HFArgs", "HFCausalLM", "hf_spec"]
