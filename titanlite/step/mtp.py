"""Multi-token prediction (DeepSeek-V3's MTP) in a step: each window's shifted copies, the
objective, and the step line's `main_loss` and `mtp_loss`.

A model with D MTP modules (`DecoderArgs.mtp_depths`; models/deepseek_v3/model.py) reads each
window with its D copies shifted left by 1..D, [batch, 1 + D, seq] (`streams`; ids past the
window's end are 0), and returns the main logits then each depth's, [batch, (1 + D) x seq,
vocab]. The labels get the same streams, IGNORE past the end: depth k at position i predicts
token i + k + 1, and the last k positions of a window are not trained at depth k (nothing in
the window follows them); with document ids (block-causal attention) neither are the positions
whose depth-k input lies in the next document (torchtitan's rule). No loader changes: the
streams are cut from the (inputs, labels) windows on the device, before context parallelism
splits the sequence, so a cp rank's shifted labels are those of the next chunk whichever rank
holds it, and the first pipeline stage embeds every stream.

The objective is main + `training.mtp_loss_weight` x the mean over depths of each depth's
cross-entropy. The main loss is computed as without MTP (the same call, the same logits), so at
weight 0 it is the same bit for bit. Depth k's loss is the sum over its trained positions
divided by their count over the step's ranks and losses (over dp x cp, as `step/loss.LabelCount`
counts masked labels), so every layout divides by what one process would. The step line's
`loss` is the objective (what is trained, as torchtitan logs it); `main_loss` and `mtp_loss`
(the mean over depths) are its parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from titanlite.data.loader import IGNORE
from titanlite.observe.metrics import LineField
from titanlite.parallel.collectives import mean_over, sum_over
from titanlite.step.loss import cross_entropy
from titanlite.step.participants import StepParticipant

Divisors = tuple[torch.Tensor | None, torch.Tensor]  # the main loss's (None: its mean), each depth's [D]


class MultiTokenPrediction(StepParticipant):
    """The MTP objective of a model with `depths` modules, and a step participant that logs
    its parts: the main loss and the mean MTP loss of the step (summed over the pipeline ranks,
    averaged over dp x cp as the loss is)."""

    def __init__(
        self,
        depths: int,
        weight: float,
        *,
        group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.depths, self.weight, self.pp_group, self.device = depths, weight, pp_group, device
        self.group = group
        self.records: list[torch.Tensor] = []  # [main, mtp] of each loss this step, weighted as it is

    def streams(self, window: torch.Tensor, fill: int) -> torch.Tensor:
        """[batch, seq] -> [batch, 1 + depths, seq]: stream k is `window` shifted left by k, `fill` past its end."""
        tail = window.new_full((window.shape[0], self.depths), fill)
        padded = torch.cat([window, tail], dim=1)
        return torch.stack([padded[:, k : k + window.shape[1]] for k in range(1 + self.depths)], dim=1)

    def within_documents(self, labels: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        """Label streams with depth k's labels IGNORE where its input, k tokens on, lies in another
        document than the position (documents [batch, seq]: the inputs' document numbers)."""
        return labels.masked_fill(self.streams(documents, -1) != documents[:, None], IGNORE)

    def divisors(self, main: torch.Tensor | None, labels: list[torch.Tensor], losses: int) -> Divisors:
        """The main loss's divisor and each depth's: its trained labels over the step's ranks, per loss."""
        counts = torch.stack([(label[:, 1:] >= 0).sum(dim=(0, 2)) for label in labels]).sum(0).float()
        return main, mean_over(self.group, counts).clamp(min=1) / losses

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, divisors: Divisors, scale: float) -> torch.Tensor:
        """main + weight x mean depth loss of logits [batch, (1 + D) x seq, vocab] against the
        label streams [batch, 1 + D, seq]; its parts recorded weighted by `scale`."""
        streams = logits.chunk(1 + self.depths, dim=1)
        main = cross_entropy(streams[0], labels[:, 0], divisors[0])
        depths = [cross_entropy(streams[k], labels[:, k], divisors[1][k - 1]) for k in range(1, 1 + self.depths)]
        mtp = torch.stack(depths).mean()
        self.records.append(torch.stack([main, mtp]).detach() * scale)
        return main + self.weight * mtp

    @contextlib.contextmanager
    def returned_only(self, losses: list[torch.Tensor]) -> Iterator[None]:
        """Around one pipeline schedule call: keep the records of the `losses` it returns. torch
        2.13's stages infer their shapes on the first call by running the loss once more, first."""
        start = len(self.records)
        yield
        del self.records[start : len(self.records) - len(losses)]

    def before_step(self, step: int, redo: bool = False) -> None:
        self.records.clear()  # the last step's, or those of a step about to be redone

    def log_fields(self) -> list[LineField]:
        parts = torch.stack(self.records).sum(0) if self.records else torch.zeros(2, device=self.device)
        main, mtp = mean_over(self.group, sum_over(self.pp_group, parts)).tolist()
        return [LineField(f"main_loss {main:.4f}  mtp_loss {mtp:.4f}", {"main_loss": main, "mtp_loss": mtp})]


def objective(
    mtp: MultiTokenPrediction | None,
    logits: torch.Tensor,
    labels: torch.Tensor,
    tokens: torch.Tensor | Divisors | None,
    scale: float,
) -> torch.Tensor:
    """A forward's loss: cross-entropy, or with label streams (MTP training) the MTP objective."""
    return cross_entropy(logits, labels, tokens) if labels.ndim == 2 else mtp(logits, labels, tokens, scale)
