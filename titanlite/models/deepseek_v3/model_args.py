"""DeepSeek-V3's hyperparameters, in their own module: the model (model.py), its attention
(attention.py) and its Hugging Face adapter all read them, and none of those imports another."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.model_spec import AttentionWidths, DecoderArgs
from titanlite.models.moe import MoEArgs
from titanlite.models.rope import YaRN


@dataclass(frozen=True)
class DeepSeekV3Args(DecoderArgs):
    """Hyperparameters of one DeepSeek-V3 flavor (HF config.json names in brackets);
    `vocab_size` is replaced by the tokenizer's. MLA has no one head_dim: the planner reads
    `attention_widths`."""

    dim: int = 2048  # [hidden_size]
    n_layers: int = 27  # [num_hidden_layers]
    n_heads: int = 16  # [num_attention_heads]
    vocab_size: int = -1
    q_lora_rank: int = 0  # 0: one query projection wq [q_lora_rank, None in HF]
    kv_lora_rank: int = 512  # [kv_lora_rank]
    qk_nope_head_dim: int = 128  # [qk_nope_head_dim]
    qk_rope_head_dim: int = 64  # [qk_rope_head_dim]
    v_head_dim: int = 128  # [v_head_dim]
    hidden_dim: int = 10944  # the dense blocks' SwiGLU width [intermediate_size]
    moe: MoEArgs | None = None  # the MoE blocks' layer; None: every block dense
    n_dense_layers: int = 1  # dense blocks before the MoE ones [first_k_dense_replace]
    norm_eps: float = 1e-6  # [rms_norm_eps]
    rope_theta: float = 10000.0  # [rope_theta]
    rope_scaling: YaRN | None = None  # [rope_scaling]
    max_seq_len: int = 4096  # [max_position_embeddings]
    tie_word_embeddings: bool = False  # [tie_word_embeddings]
    attn_mask_type: str = "causal"  # models/attention.py
    depth_init: bool = True  # depth-scaled init of the output projections, as Llama's
    num_nextn_predict_layers: int = 0  # multi-token prediction modules, numbered on from n_layers [same name]

    def __post_init__(self) -> None:
        if self.q_lora_rank < 0 or min(self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim) <= 0:
            raise ValueError(f"DeepSeekV3Args: ranks and head dims must be positive: {self}")
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"DeepSeekV3Args.num_nextn_predict_layers must be >= 0: {self}")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepSeekV3Args.qk_rope_head_dim must be even and positive, got {self.qk_rope_head_dim}")

    @property
    def mtp_depths(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key width: [nope | rope]."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when
        YaRN has mscale_all_dim (transformers' yarn_apply_mscale)."""
        if self.rope_scaling is None:
            return self.qk_head_dim**-0.5
        return self.rope_scaling.softmax_scale(self.qk_head_dim)

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    @property
    def attention_widths(self) -> AttentionWidths:
        """Per token: queries and keys n_heads x qk_head_dim (the rope part rotated), values and
        the output projection's input n_heads x v_head_dim; whole on every tp rank, the latents
        autograd keeps: wkv_a's output, the normalized latent and [latent | k_pe] (gathered
        under cp), and with the low-rank query path wq_a's output and its norm's."""
        qk, v = self.n_heads * self.qk_head_dim, self.n_heads * self.v_head_dim
        kv_latent = 2 * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        return AttentionWidths(q=qk, k=qk, v=v, out=v, latent=kv_latent + 2 * self.q_lora_rank)

    def moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has the MoE feed-forward (HF's first_k_dense_replace rule)."""
        return self.moe is not None and layer_id >= self.n_dense_layers
