"""GPT-2: the model, its flavors and its tensor-parallel plan, as one registry entry."""

from titanlite.models.gpt2.model import GPT2, GPT2Args
from titanlite.models.gpt2.parallelize import apply_tp, tp_problems
from titanlite.model_spec import Capabilities, ModelSpec, transformer_flops_per_token

gpt2_flavors: dict[str, GPT2Args] = {
    # CPU-sized, like llama3's debugmodel.
    "debugmodel": GPT2Args(dim=256, n_layers=4, n_heads=8, max_seq_len=2048),
    # OpenAI's smallest GPT-2 (124M parameters with its 50257-token vocab and a tied head;
    # the head here is untied).
    "124M": GPT2Args(dim=768, n_layers=12, n_heads=12, max_seq_len=1024),
}


def flops_per_token(args: GPT2Args, n_params: int, seq_len: int) -> float:
    """Both embedding tables are lookups, not matmuls."""
    lookups = (args.vocab_size + args.max_seq_len) * args.dim
    return transformer_flops_per_token(n_params - lookups, args.n_layers, args.dim, seq_len)


gpt2_spec = ModelSpec(
    name="gpt2",
    model_class=GPT2,
    flavors=gpt2_flavors,
    apply_tp=apply_tp,
    tp_problems=tp_problems,
    flops_per_token=flops_per_token,
    # Its attention has no cp gather (learned positions would also need each rank's global
    # ones) and it has neither a KV cache nor a Hugging Face mapping yet.
    capabilities=Capabilities(pipeline_split=True, document_mask=True),
    # Both embedding tables, the LayerNorms' weights, and every bias.
    no_decay=("embeddings.*", "*ln_*.weight", "*.bias"),
)

__all__ = ["GPT2", "GPT2Args", "gpt2_flavors", "gpt2_spec"]
