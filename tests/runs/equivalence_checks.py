"""The checks the equivalence files share (tests/runs/equivalence.py has the layouts): a
layout's curve against its reference and each rank's share of the parameters and routed
experts, float8 layouts within float8's tolerances, Muon's per-rank work, GPT-2's TP plan."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import EQUIVALENCE_ARGS, assert_same_curve
from tests.helpers.sessions import SessionCases
from tests.runs.equivalence import (
    CP,
    EP,
    ETP,
    FLOAT8_LAYOUTS,
    LAYOUTS,
    LORA_LAYOUTS,
    MUON,
    ONE_TOKEN,
    OWN_CHECK_LAYOUTS,
    PP,
)
from titanlite.build import plan_run
from titanlite.config.load import load_config
from titanlite.models.moe import moe_layers

PER_RANK_DEGREES = ("pipeline_parallel_degree", "tensor_parallel_degree", "data_parallel_replicate_degree")


def assert_expert_shares(ranks: list[dict], reference: dict, overrides: list[str], nproc: int) -> None:
    """Under ep each rank computes with 1/ep of its stage's routed experts (as FSDP's
    all-gather hands them to forward) and holds 1/(ep x efsdp) = 1/(dp_shard x cp) of them;
    expert tensor parallelism splits each expert over tp on top (1/etp of both). A rank's stage
    share is its stages' MoE layers (`moe_layer_shares`: DeepSeek-V3's dense first block leaves
    the first stage fewer). An ep or etp that the layout ignores computes with every expert
    (or whole experts), so it fails here, though its curve is the reference's."""
    value = dict(zip(overrides[::2], overrides[1::2]))
    whole = reference["expert_compute_bytes"]  # one process: every expert of every layer
    pp, tp, replicate = (int(value.get(f"--parallelism.{key}", 1)) for key in PER_RANK_DEGREES)
    ep, etp = int(value.get(EP[0], 1)), int(value.get(ETP[0], 1))
    assert whole > 0
    dp_shard_cp = nproc // (pp * tp * replicate)
    here = [whole * share / etp for share in moe_layer_shares(overrides, nproc)]  # a tp rank: its slice of each expert
    compute, held = ([r[key] for r in ranks] for key in ("expert_compute_bytes", "expert_param_bytes"))
    assert compute == pytest.approx([bytes_ / ep for bytes_ in here], rel=0.05), "expert_compute_bytes by rank"
    assert held == pytest.approx([bytes_ / dp_shard_cp for bytes_ in here], rel=0.05), "expert_param_bytes by rank"


def moe_layer_shares(overrides: list[str], nproc: int) -> list[float]:
    """Each rank's share of the model's MoE layers, from the layout's own plan: all of them
    without pp; under pp those of the stages its pp rank holds (pp is the outermost mesh dim)."""
    if PP[0] not in overrides:
        return [1.0] * nproc
    plan = plan_run(load_config([*EQUIVALENCE_ARGS, *overrides]), nproc)
    with torch.device("meta"):
        blocks = [name.split(".")[1] for name in moe_layers(plan.spec.model_class(plan.model_args))]
    pipeline, per_pp_rank = plan.pipeline, nproc // plan.pipeline.degree
    stage_blocks = [
        [b for s in pipeline.stage_indices(r) for b in pipeline.stages[s].blocks] for r in range(pipeline.degree)
    ]
    return [sum(b in blocks for b in stage_blocks[rank // per_pp_rank]) / len(blocks) for rank in range(nproc)]


def degrees(overrides: list[str], nproc: int) -> tuple[int, int]:
    """(dp_shard, tp) of a layout without pipeline or context parallelism, for the expected per-rank share."""
    value = dict(zip(overrides[::2], overrides[1::2]))
    tp = int(value.get("--parallelism.tensor_parallel_degree", 1))
    replicate = int(value.get("--parallelism.data_parallel_replicate_degree", 1))
    return nproc // (tp * replicate), tp


def check_layout(layout: str, sessions: SessionCases) -> None:
    """The layout's curve is its reference's (and its expert load, validation loss), its ranks
    hold their shares of the routed experts, and, without pp or cp, of every parameter."""
    nproc, overrides, reference_name = LAYOUTS[layout]
    reference = sessions[f"reference_{reference_name}"]
    assert reference["history"][-1]["loss"] < reference["history"][0]["loss"]
    assert_same_curve(sessions[layout]["history"], reference["history"], layout)
    if "mtp_loss" in reference["history"][0]:  # multi-token prediction's parts of the loss
        for key in ("main_loss", "mtp_loss"):
            assert [h[key] for h in sessions[layout]["history"]] == pytest.approx(
                [h[key] for h in reference["history"]], rel=1e-5
            ), key
    if "moe_load_mean" in reference["history"][0]:  # the same routing: the same expert load, every layer (all stages)
        # Muon's Newton-Schulz runs in bfloat16 (as torch's): the 1e-7 differences of sharded gradient
        # sums can round a matrix entry to the next bfloat16, enough to send a near-tie token to its
        # other expert. Its load then agrees within one token of a layer's mean load (loss and grad
        # norm still within 1e-5, above).
        tolerance = {"abs": ONE_TOKEN} if MUON[1] in overrides else {"rel": 1e-6}
        for key in ("moe_load_mean", "moe_load_max"):
            assert [h[key] for h in sessions[layout]["history"]] == pytest.approx(
                [h[key] for h in reference["history"]], **tolerance
            ), key
    if reference["validation_loss"] is not None:  # validation through the same layout's forward
        assert sessions[layout]["validation_loss"] == pytest.approx(reference["validation_loss"], rel=1e-5)

    if EP[0] in overrides or ETP[0] in overrides:
        assert_expert_shares(sessions[layout]["ranks"], reference["ranks"][0], overrides, nproc)
    if any(flag in overrides for flag in (PP[0], CP[0])):
        return  # stages and sequence shards hold other shares; the planner tests check those
    dp_shard, tp = degrees(overrides, nproc)
    split_experts = reference["ranks"][0]["expert_param_bytes"] if ETP[0] in overrides else 0  # split over tp
    for sizes in sessions[layout]["ranks"]:
        # replicated over tp, sharded by FSDP: norms, MoE routers and routed experts (unless etp
        # splits them), MLA's latent projections
        whole_on_tp = sizes["norm_param_bytes"] + sizes["moe_param_bytes"] + sizes["latent_param_bytes"]
        whole_on_tp -= split_experts
        expected = (sizes["full_param_bytes"] - whole_on_tp) / (dp_shard * tp) + whole_on_tp / dp_shard
        for kind, factor in (("param_bytes", 1), ("grad_bytes", 1), ("optim_bytes", 2)):  # AdamW: exp_avg, exp_avg_sq
            if kind == "optim_bytes" and MUON[1] in overrides:
                continue  # Muon keeps one buffer per matrix, AdamW two per other parameter
            assert sizes[kind] == pytest.approx(factor * expected, rel=0.05), f"{kind} on a rank of {layout}"


def check_lora_layout(layout: str, sessions: SessionCases) -> None:
    """A LoRA layout's curve is its one-process reference's; only the adapters are trained: each
    rank holds gradients and AdamW's two moments for its share of them and nothing for the frozen
    weights, and that share is the layout's (adapters laid out like their base weights, then
    sharded by FSDP): a TP that left the adapters whole, or sharded A with B, holds another."""
    _, _, reference_name, share = LORA_LAYOUTS[layout]
    reference = sessions[f"reference_{reference_name}"]
    assert reference["history"][-1]["loss"] < reference["history"][0]["loss"]
    assert_same_curve(sessions[layout]["history"], reference["history"], layout)
    whole = reference["ranks"][0]
    assert 0 < whole["full_param_bytes"] < whole["frozen_param_bytes"] / 20, "adapters only are trained"
    for sizes in sessions[layout]["ranks"]:
        assert sizes["frozen_param_bytes"] > 0 and sizes["frozen_grad_bytes"] == 0
        assert sizes["grad_bytes"] == sizes["param_bytes"] and sizes["optim_bytes"] == 2 * sizes["param_bytes"]
        if share is not None:
            assert sizes["param_bytes"] == pytest.approx(share * whole["full_param_bytes"]), layout


# float8's casts round at the 4th bit (e4m3) and the 3rd (e5m2 gradients): a layout's sums in
# another order (TP's partial products, FSDP's reduce-scatter) move a few values across a
# rounding boundary, a step in the 4th bit each. On the first step (the same weights) that
# leaves the loss within 1e-6 and the grad norm within 2e-5 (measured 0 and 7.5e-6); each AdamW
# step then carries the flips into the weights (first steps move every weight by about lr, whatever
# the size of its gradient): measured up to 2e-5 on the loss and 1.5e-4 on the grad norm by step 5 (the tests train 3).
FLOAT8_FIRST_STEP_REL = {"loss": 1e-6, "grad_norm": 2e-5}
FLOAT8_REL = {"loss": 1e-4, "grad_norm": 1e-3}


def check_float8_layout(layout: str, sessions: SessionCases) -> None:
    """Each step's loss and grad norm within the float8 tolerances above of one float8 process."""
    _, _, reference_name = FLOAT8_LAYOUTS[layout]
    history, reference = sessions[layout]["history"], sessions[f"reference_{reference_name}"]["history"]
    assert [h["step"] for h in history] == [h["step"] for h in reference]
    for step, (ours, ref) in enumerate(zip(history, reference), start=1):
        for key in ("loss", "grad_norm"):
            rel = (FLOAT8_FIRST_STEP_REL if step == 1 else FLOAT8_REL)[key]
            assert ours[key] == pytest.approx(ref[key], rel=rel), (
                f"{layout} step {step} {key}: {ours[key]} vs {ref[key]}"
            )


def check_muon(layout: str, sessions: SessionCases) -> None:
    """Every matrix orthogonalized by one rank, each rank a share, each receiving only its own blocks."""
    nproc, overrides, reference_name = LAYOUTS[layout]
    whole = sessions[f"reference_{reference_name}"]["ranks"][0]
    ranks = sessions[layout]["ranks"]
    owned = [r["muon_owned"] for r in ranks]
    assert whole["muon_owned"] > 0 and sum(owned) == whole["muon_owned"]
    assert all(0 < n < whole["muon_owned"] for n in owned), owned
    if PP[0] in overrides:  # each stage's matrices are whole on its rank: nothing to gather
        assert [r["muon_gathered_bytes"] for r in ranks] == [0] * nproc
        return
    everything = whole["muon_matrix_bytes"] * (nproc - 1) / nproc
    assert all(0 < r["muon_gathered_bytes"] < everything for r in ranks), [r["muon_gathered_bytes"] for r in ranks]


def tp_replicated_bytes() -> int:
    """fp32 bytes the GPT-2 TP plan leaves whole on every tp rank: the position table,
    the LayerNorms and the row-parallel (c_proj) biases."""
    from tests.unit.test_gpt2 import build_on_meta
    from titanlite.models.gpt2 import gpt2_spec

    model = build_on_meta(gpt2_spec.args_for("debugmodel", vocab_size=128))
    replicated = [
        p for name, p in model.named_parameters() if "wpe" in name or "ln_" in name or name.endswith("c_proj.bias")
    ]
    return sum(p.numel() for p in replicated) * 4


def check_gpt2_tp(layout: str, sessions: SessionCases) -> None:
    """The real trainer, fp32, same seed and global batch: GPT-2 at TP 2 (loss parallel) and
    FSDP 2 x TP 2 gives the 1-process losses and grad norms to 1e-5 relative over 5 AdamW
    steps with clipping (a wrong plan is off by 1e-4 or more), and each rank holds only
    its share of the weights, so the match is not a plan that did nothing."""
    nproc = OWN_CHECK_LAYOUTS[layout][0]
    result, reference = sessions[layout], sessions["reference_gpt2"]["history"]
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert_same_curve(result["history"], reference, layout)
    tp, dp_shard = 2, nproc // 2
    replicated = tp_replicated_bytes()
    for sizes in result["ranks"]:
        expected = ((sizes["full_param_bytes"] - replicated) / tp + replicated) / dp_shard
        for kind, factor in (("param_bytes", 1), ("grad_bytes", 1), ("optim_bytes", 2)):  # AdamW: exp_avg, exp_avg_sq
            assert sizes[kind] == pytest.approx(factor * expected, rel=0.01), f"{kind} on a rank of {layout}"
