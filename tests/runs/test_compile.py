"""torch.compile per block trains like eager (issue: throughput).

In one process on every available device (CPU always; CUDA when present): a small Llama,
3 AdamW steps, compiled blocks against eager from the same weights and batches. Through the
real trainer on 4 gloo processes, FSDP 2 x TP 2 with compiled blocks (DTensor inside the
graphs, FSDP hooks outside) against the 1-process eager reference of the layout tests is a
case of their 4-process session: test_parallel_equivalence_4ranks.py
(test_compiled_fsdp_tp_matches_eager_single_process).

Tolerances: float32 throughout. On CPU compiled and eager losses matched to the last bit
here (torch 2.13); 1e-5 relative is the layout tests' bound. On CUDA, fused reductions sum
in other orders, so 1e-4 (not measured in this repo's CI, which has no GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanlite.models.llama import LlamaArgs, llama3_spec
from titanlite.parallel.compile import apply_compile
from titanlite.parallel.units import model_blocks

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}
ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)


def train_losses(device: str, compiled: bool, steps: int = 3) -> list[float]:
    with torch.device("meta"):
        model = llama3_spec.model_class(ARGS)
    if compiled:
        apply_compile(model, model_blocks(model))
    model.to_empty(device=device)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=generator).to(device)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_blocks_train_like_eager(device):
    eager, compiled = train_losses(device, compiled=False), train_losses(device, compiled=True)
    assert compiled == pytest.approx(eager, rel=TOLERANCE[device])
    assert eager[-1] < eager[0]
