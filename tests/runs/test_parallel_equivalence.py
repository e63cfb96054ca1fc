"""Every parallel layout trains exactly like one process: FSDP, HSDP, replicate-only data
parallelism, TP, accumulation, activation checkpointing, CPU offload, pipeline parallelism
with each schedule, context parallelism, expert parallelism (inside HSDP too) and expert
tensor parallelism, at degree 2 and above (pp, cp and tp 4, ep 4 and 8), and their
combinations (every dimension at once in one 16-process session), with causal and
block-causal (document) attention; and every FSDP strategy and option shows its effect (the
last section).

Real gloo runs of the trainer on the debug model, fp32, fixed seed, the same global batch of
8 windows: losses and gradient norms of each step match the single-process reference within
1e-5 relative, and where FSDP and TP share the model each rank holds only its share of
parameters, gradients and optimizer state. Layouts of one world size run as cases of one
training session (tests/helpers/sessions.py): one process start and rendezvous per world size.
"""

from __future__ import annotations

import fnmatch
import json

import pytest

from tests.helpers.distributed import EQUIVALENCE_ARGS, REPO, assert_same_curve, timeout_scale
from tests.helpers.sessions import Case, SessionCases, run_session
from titanlite.step.optim import lr_factor

PP = ["--parallelism.pipeline_parallel_degree", "2"]
CP = ["--parallelism.context_parallel_degree", "2"]
TP = ["--parallelism.tensor_parallel_degree", "2"]
BLOCK = ["--model.attn_mask_type", "block_causal"]
GPT2 = ["--model.name", "gpt2"]
QWEN3 = ["--model.name", "qwen3"]
QWEN3_MOE = [*QWEN3, "--model.flavor", "debugmodel_moe"]
QWEN3_MOE_AUX = [*QWEN3, "--model.flavor", "debugmodel_moe_aux"]
EP = ["--parallelism.expert_parallel_degree", "2"]
MUON = ["--optimizer.name", "Muon"]
# Moonlight's lr scale on the MoE model: its update RMS matches AdamW's at the same lr.
MUON_RMS = [*MUON, "--optimizer.muon_adjust_lr", "match_rms_adamw"]
REPLICATE = ["--parallelism.data_parallel_replicate_degree", "2"]
ETP = ["--parallelism.expert_tensor_parallel_degree", "2"]
FLOAT8 = [
    "--model.converters",
    "float8",
    "--float8.enable_fsdp_float8_all_gather",
    "true",
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
    "true",
]
FLOAT8_ROWWISE = ["--model.converters", "float8", "--float8.recipe_name", "rowwise"]
DSV3 = ["--model.name", "deepseek_v3"]
DSV3_Q_LORA = [*DSV3, "--model.flavor", "debugmodel_q_lora"]
SP = ["--parallelism.sequence_parallel", "on"]
# Validated at the end: the held-out windows exist whether validation is on or not, so the
# training curve is the causal reference's too.
VALIDATION = ["--validation.enable", "true", "--validation.freq", "100", "--validation.steps", "2"]


def batch(n: int) -> list[str]:
    return ["--training.local_batch_size", str(n)]


def schedule(name: str, degree: int = 2) -> list[str]:
    return ["--parallelism.pipeline_parallel_degree", str(degree), "--parallelism.pipeline_parallel_schedule", name]


def at_degree(flag: list[str], n: int) -> list[str]:
    """A parallelism flag (PP, CP, TP, EP) at degree `n`."""
    return [flag[0], str(n)]


# One routed token in the MoE load (busiest expert's tokens over the mean): global batch 8 x 64 tokens,
# each sent to 2 of the flavor's 8 experts, a mean of 128 per expert.
ONE_TOKEN = 1 / (8 * 64 * 2 / 8)
# optimizer.param_groups in a TOML file (the 1-process session trains with it): two rules, the rest default.
TWO_GROUPS = ["layers.*.attention.w*: lr_scale=0.5 weight_decay=0.05", "tok_embeddings.* *norm.weight: weight_decay=0"]

# The single-process references, by the model options they share with their layouts.
REFERENCES = {
    "causal": [],
    "block_causal": BLOCK,
    "gpt2": GPT2,
    "validation": VALIDATION,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "qwen3_moe_aux": QWEN3_MOE_AUX,
    "muon": MUON,
    "qwen3_moe_muon": [*QWEN3_MOE, *MUON_RMS],
    # float8 scales each activation by its amax over the microbatch: the references run the
    # layouts' microbatches of 4 (accumulating 2), so every cast sees what a layout's rank sees.
    "float8": [*batch(4), "--training.global_batch_size", "8", *FLOAT8],
    "float8_rowwise": [*batch(4), "--training.global_batch_size", "8", *FLOAT8_ROWWISE],
    "deepseek_v3": DSV3,
    "deepseek_v3_q_lora_block_causal": [*DSV3_Q_LORA, *BLOCK],
}

# name: (processes, overrides, reference). Global batch 8 = local_batch_size x dp x accumulation;
# pipeline and context-parallel ranks of one dp rank share its batch.
LAYOUTS = {
    "fsdp2": (2, batch(4), "causal"),
    "tp2": (2, [*batch(8), *TP], "causal"),
    # Replicate-only data parallelism: whole weights, gradients all-reduced (no FSDP of degree 1).
    "replicate2": (2, [*batch(4), *REPLICATE, "--parallelism.data_parallel_shard_degree", "1"], "causal"),
    "fsdp2_accum2": (2, [*batch(2), "--training.global_batch_size", "8"], "causal"),
    "fsdp2_offload": (2, [*batch(4), "--training.enable_cpu_offload", "true"], "causal"),
    # Every FSDP option, three to a run (each run one process start less): nested shard units
    # (children first), each reshard policy, explicit prefetch, full, per-op and every-k-th-block
    # activation checkpointing. The integer reshard is fsdp4_reshard_to_2.
    "fsdp2_nested_reshard_always_ac": (
        2,
        [
            *batch(4),
            "--parallelism.fsdp_shard_modules",
            "TransformerBlock,Attention,FeedForward",
            "--parallelism.fsdp_reshard_after_forward",
            "always",
            "--activation_checkpoint.mode",
            "full",
        ],
        "causal",
    ),
    "fsdp2_reshard_never_prefetch1_ac_every_2nd": (
        2,
        [
            *batch(4),
            "--parallelism.fsdp_reshard_after_forward",
            "never",
            "--parallelism.fsdp_prefetch_depth",
            "1",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
        ],
        "causal",
    ),
    "fsdp2_prefetch2_nested_ac_per_op": (
        2,
        [
            *batch(4),
            "--parallelism.fsdp_prefetch_depth",
            "2",
            "--parallelism.fsdp_shard_modules",
            "TransformerBlock,Attention",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
        "causal",
    ),
    # Split by counted FLOPs: the head weighs ~1.3 blocks at seq 64, so 4 blocks | 2 + head (3 | 3 by layers).
    "pp2_gpipe_balance_flops": (
        2,
        [*batch(8), *schedule("GPipe"), "--parallelism.pipeline_parallel_balance", "flops"],
        "causal",
    ),
    "pp2_1f1b": (2, [*batch(8), *schedule("1F1B")], "causal"),
    "pp2_interleaved_1f1b": (2, [*batch(8), *schedule("Interleaved1F1B")], "causal"),
    "pp2_zbv": (2, [*batch(8), *schedule("ZBVZeroBubble")], "causal"),
    "pp2_interleaved_zero_bubble": (2, [*batch(8), *schedule("InterleavedZeroBubble")], "causal"),
    "pp2_looped_bfs": (2, [*batch(8), *schedule("LoopedBFS")], "causal"),
    "pp2_dualpipev_accum2": (2, [*batch(4), "--training.global_batch_size", "8", *schedule("DualPipeV")], "causal"),
    "pp2_gpt2": (2, [*batch(8), *PP, *GPT2], "gpt2"),
    "pp2_validation": (2, [*batch(8), *PP, *VALIDATION], "validation"),
    "cp2": (2, [*batch(8), *CP], "causal"),
    "cp2_block_causal": (2, [*batch(8), *CP, *BLOCK], "block_causal"),
    "cp2_validation": (2, [*batch(8), *CP, *VALIDATION], "validation"),
    "fsdp2_block_causal": (2, [*batch(4), *BLOCK], "block_causal"),
    "tp2_block_causal": (2, [*batch(8), *TP, *BLOCK], "block_causal"),
    # Sequence parallelism is the GPU default (off on CPU), so FSDP 2 x TP 2 is checked with it
    # here; without it (the CPU default) in test_tied_embeddings.py, test_gpt2.py, test_compile.py.
    "fsdp2_tp2_sp": (4, [*batch(4), *TP, "--parallelism.sequence_parallel", "on"], "causal"),
    "replicate2_tp2": (4, [*batch(4), *REPLICATE, "--parallelism.data_parallel_shard_degree", "1", *TP], "causal"),
    "hsdp2x2": (4, [*batch(2), "--parallelism.data_parallel_replicate_degree", "2"], "causal"),
    "fsdp4_reshard_to_2": (4, [*batch(2), "--parallelism.fsdp_reshard_after_forward", "2"], "causal"),
    "pp2_fsdp2": (4, [*batch(4), *PP], "causal"),
    "pp2_tp2": (4, [*batch(8), *PP, *TP], "causal"),
    "cp2_fsdp2": (4, [*batch(4), *CP], "causal"),
    "cp2_fsdp2_block_causal": (4, [*batch(4), *CP, *BLOCK], "block_causal"),
    "cp2_tp2_sp": (4, [*batch(8), *CP, *TP, "--parallelism.sequence_parallel", "on"], "causal"),
    "cp2_tp2_block_causal": (4, [*batch(8), *CP, *TP, *BLOCK], "block_causal"),
    "cp2_pp2_block_causal": (4, [*batch(8), *CP, *PP, *BLOCK], "block_causal"),
    # Qwen3 dense and MoE (8 experts, top-2, aux loss and expert bias) at each parallelism:
    # the MoE layer runs whole on each tp rank, its aux loss trains through the pipeline
    # schedule, its per-sequence counts are summed over cp, its bias over dp x cp.
    "qwen3_fsdp2": (2, [*batch(4), *QWEN3], "qwen3"),
    "qwen3_tp2": (2, [*batch(8), *TP, *QWEN3], "qwen3"),
    "qwen3_pp2": (2, [*batch(8), *PP, *QWEN3], "qwen3"),
    "qwen3_cp2": (2, [*batch(8), *CP, *QWEN3], "qwen3"),
    "qwen3_moe_fsdp2": (2, [*batch(4), *QWEN3_MOE], "qwen3_moe"),
    "qwen3_moe_tp2": (2, [*batch(8), *TP, *QWEN3_MOE], "qwen3_moe"),
    "qwen3_moe_pp2": (2, [*batch(8), *PP, *QWEN3_MOE], "qwen3_moe"),
    "qwen3_moe_cp2": (2, [*batch(8), *CP, *QWEN3_MOE], "qwen3_moe"),
    # Expert parallelism: the routed experts split over ep ranks borrowed from dp_shard x cp,
    # tokens exchanged by all-to-all, with the bias-balanced router and the aux-loss one; under
    # full activation checkpointing once (the recompute repeats the exchange, and the counts).
    "qwen3_moe_ep2_ac_full": (2, [*batch(4), *EP, *QWEN3_MOE, "--activation_checkpoint.mode", "full"], "qwen3_moe"),
    "qwen3_moe_aux_ep2": (2, [*batch(4), *EP, *QWEN3_MOE_AUX], "qwen3_moe_aux"),
    "qwen3_moe_aux_ep2_cp2": (2, [*batch(8), *EP, *CP, *QWEN3_MOE_AUX], "qwen3_moe_aux"),
    "qwen3_moe_ep2_fsdp4": (4, [*batch(2), *EP, *QWEN3_MOE], "qwen3_moe"),
    # ep inside HSDP (ep borrows dp_shard, the experts replicated over dp_replicate like the rest)
    "qwen3_moe_ep2_hsdp2x2": (4, [*batch(2), *EP, *REPLICATE, *QWEN3_MOE], "qwen3_moe"),
    "qwen3_moe_aux_ep2_tp2": (4, [*batch(4), *EP, *TP, *QWEN3_MOE_AUX], "qwen3_moe_aux"),
    # Expert tensor parallelism: each routed expert's weights split over tp (alone, and with ep).
    "qwen3_moe_aux_etp2_tp2": (2, [*batch(8), *TP, *ETP, *QWEN3_MOE_AUX], "qwen3_moe_aux"),
    "qwen3_moe_etp2_ep2_tp2": (4, [*batch(4), *EP, *TP, *ETP, *QWEN3_MOE], "qwen3_moe"),
    "qwen3_moe_ep2_pp2": (4, [*batch(4), *EP, *PP, *QWEN3_MOE], "qwen3_moe"),
    "qwen3_fsdp2_tp2": (4, [*batch(4), *TP, *QWEN3], "qwen3"),
    "qwen3_moe_fsdp2_tp2_sp": (4, [*batch(4), *TP, "--parallelism.sequence_parallel", "on", *QWEN3_MOE], "qwen3_moe"),
    # Muon: every matrix orthogonalized whole on one owner rank (step/muon.py), each routed expert
    # on its own; the per-rank shares of that work are checked below.
    "muon_fsdp2": (2, [*batch(4), *MUON], "muon"),
    "muon_tp2": (2, [*batch(8), *TP, *MUON], "muon"),
    "muon_pp2": (2, [*batch(8), *PP, *MUON], "muon"),
    "muon_qwen3_moe_ep2": (2, [*batch(4), *EP, *QWEN3_MOE, *MUON_RMS], "qwen3_moe_muon"),
    "muon_fsdp2_tp2": (4, [*batch(4), *TP, *MUON], "muon"),
    # Degrees above 2: pp 4 with each schedule kind (one stage per rank, 8 stages looped, two
    # V shapes; the debug model's 6 blocks plus the embedding and head make 8 one-block stages),
    # cp 4 with both masks, tp 4, ep 4 (2 experts a rank) and ep 8 (one expert a rank) x FSDP 8.
    "pp4_1f1b": (4, [*batch(8), *schedule("1F1B", 4)], "causal"),
    "pp4_interleaved_1f1b_8_stages": (4, [*batch(8), *schedule("Interleaved1F1B", 4)], "causal"),
    "pp4_zbv": (4, [*batch(8), *schedule("ZBVZeroBubble", 4)], "causal"),
    "pp4_dualpipev": (4, [*batch(8), *schedule("DualPipeV", 4)], "causal"),
    "cp4": (4, [*batch(8), *at_degree(CP, 4)], "causal"),
    "cp4_block_causal": (4, [*batch(8), *at_degree(CP, 4), *BLOCK], "block_causal"),
    "tp4": (4, [*batch(8), *at_degree(TP, 4)], "causal"),
    "qwen3_moe_ep4": (4, [*batch(2), *at_degree(EP, 4), *QWEN3_MOE], "qwen3_moe"),
    "qwen3_moe_ep8_fsdp8": (8, [*batch(1), *at_degree(EP, 8), *QWEN3_MOE], "qwen3_moe"),
    # DeepSeek-V3 (MLA, 1 dense block, then MoE with group-limited sigmoid routing, a shared
    # expert and the expert bias) at each parallelism: MLA split by heads with its latents
    # replicated (and the low-rank query path, sequence parallel and documents once), its
    # latents gathered over cp, its experts over ep, alone and with tp or pp.
    "deepseek_v3_fsdp2": (2, [*batch(4), *DSV3], "deepseek_v3"),
    "deepseek_v3_tp2": (2, [*batch(8), *TP, *DSV3], "deepseek_v3"),
    "deepseek_v3_pp2": (2, [*batch(8), *PP, *DSV3], "deepseek_v3"),
    "deepseek_v3_cp2": (2, [*batch(8), *CP, *DSV3], "deepseek_v3"),
    "deepseek_v3_ep2": (2, [*batch(4), *EP, *DSV3], "deepseek_v3"),
    "deepseek_v3_q_lora_tp2_sp_block_causal": (
        2,
        [*batch(8), *TP, *SP, *DSV3_Q_LORA, *BLOCK],
        "deepseek_v3_q_lora_block_causal",
    ),
    "deepseek_v3_q_lora_cp2_block_causal": (
        2,
        [*batch(8), *CP, *DSV3_Q_LORA, *BLOCK],
        "deepseek_v3_q_lora_block_causal",
    ),
    "deepseek_v3_ep2_tp2": (4, [*batch(4), *EP, *TP, *DSV3], "deepseek_v3"),
    "deepseek_v3_ep2_pp2": (4, [*batch(4), *EP, *PP, *DSV3], "deepseek_v3"),
    "pp2_dp2_tp2": (8, [*batch(4), *PP, *TP], "causal"),
    "cp2_hsdp2x2": (8, [*batch(2), *CP, "--parallelism.data_parallel_replicate_degree", "2"], "causal"),
}
# float8 (tests/unit/test_float8.py has the rest), checked by test_float8_layout_matches_one_float8_process:
# FSDP gathering float8 with precomputed scales, and under TP too (torchao's float8 TP styles
# on this CPU, without sequence parallelism); the rowwise recipe under TP (the plain styles).
FLOAT8_LAYOUTS = {
    "float8_fsdp2": (2, [*batch(4), *FLOAT8], "float8"),
    "float8_rowwise_tp2": (2, [*batch(4), "--training.global_batch_size", "8", *TP, *FLOAT8_ROWWISE], "float8_rowwise"),
    "float8_fsdp2_tp2": (4, [*batch(4), *TP, *FLOAT8], "float8"),
}
# Hang guards per session, which run_ranks scales by the host's load (the marks below too).
TIMEOUT_S = {1: 240, 2: 420, 4: 600, 8: 600}
ALL_DIMENSIONS_TIMEOUT_S = 900
# Every dimension at once, 16 processes, one session of its own (slow: about 330 s of wall
# on a busy 2-core host): the dense model at pp 2 x dp_shard 2 x cp 2 x tp 2, Qwen3-MoE
# with ep 2 borrowed inside pp 2 x HSDP (dp_replicate 2 x dp_shard 2) x tp 2, and DeepSeek-V3
# with ep 2 borrowed from dp_shard 2 x cp 2 inside pp 2 x tp 2; their per-rank expert bytes
# asserted (an ep the layout ignored would compute with every expert).
ALL_DIMENSIONS_WORLD = 16
ALL_DIMENSIONS = {
    "pp2_dp2_cp2_tp2": ([*batch(4), *PP, *CP, *TP], "causal"),
    "qwen3_moe_ep2_pp2_hsdp2x2_tp2": ([*batch(2), *EP, *PP, *REPLICATE, *TP, *QWEN3_MOE], "qwen3_moe"),
    "deepseek_v3_ep2_pp2_dp2_cp2_tp2": ([*batch(4), *EP, *PP, *CP, *TP, *DSV3], "deepseek_v3"),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> SessionCases:
    """Every reference and layout, one session per world size; case name -> result (a
    session that timed out fails the first test that needs one of its unfinished cases)."""
    results = SessionCases()
    references = [Case(f"reference_{name}", [*EQUIVALENCE_ARGS, *batch(8), *argv]) for name, argv in REFERENCES.items()]
    toml = tmp_path_factory.mktemp("groups") / "groups.toml"
    text = (REPO / "train_configs" / "debug_model.toml").read_text()
    toml.write_text(text.replace("[optimizer]\n", "[optimizer]\nparam_groups = " + json.dumps(TWO_GROUPS) + "\n", 1))
    groups = Case("param_groups_toml", ["--config", str(toml), *EQUIVALENCE_ARGS[2:], *batch(8)])
    by_world = {1: [*references, groups]}
    for name, (nproc, overrides, _) in {**LAYOUTS, **FLOAT8_LAYOUTS}.items():
        by_world.setdefault(nproc, []).append(Case(name, [*EQUIVALENCE_ARGS, *overrides]))
    by_world[4].append(Case("fsdp_options", [], call="tests.helpers.fsdp_options_checks:run_checks"))
    by_world[2].append(Case("expert_parallel_layer", [], call="tests.helpers.expert_parallel_checks:run_checks"))
    by_world[2].append(Case("float8_fsdp", [], call="tests.helpers.float8_checks:run_checks"))
    for nproc, cases in by_world.items():
        results.add(run_session(nproc, cases, tmp_path_factory.mktemp(f"world{nproc}"), TIMEOUT_S[nproc]))
    return results


PER_RANK_DEGREES = ("pipeline_parallel_degree", "tensor_parallel_degree", "data_parallel_replicate_degree")


def assert_expert_shares(ranks: list[dict], reference: dict, overrides: list[str], nproc: int) -> None:
    """Under ep each rank computes with 1/ep of its stage's routed experts (as FSDP's
    all-gather hands them to forward) and holds 1/(ep x efsdp) = 1/(dp_shard x cp) of them;
    expert tensor parallelism splits each expert over tp on top (1/etp of both). An ep or etp
    that the layout ignores computes with every expert (or whole experts), so it fails here,
    though its curve is the reference's."""
    value = dict(zip(overrides[::2], overrides[1::2]))
    whole = reference["expert_compute_bytes"]  # one process: every expert of every layer
    pp, tp, replicate = (int(value.get(f"--parallelism.{key}", 1)) for key in PER_RANK_DEGREES)
    ep, etp = int(value.get(EP[0], 1)), int(value.get(ETP[0], 1))
    here = whole / pp / etp  # a pipeline stage holds its share of the MoE layers, a tp rank its slice of each expert
    assert whole > 0
    dp_shard_cp = nproc // (pp * tp * replicate)
    compute, held = ([r[key] for r in ranks] for key in ("expert_compute_bytes", "expert_param_bytes"))
    if pp > 1:  # stages hold unequal numbers of MoE layers (DeepSeek-V3's dense first block): the totals
        compute, held, nproc = [sum(compute)], [sum(held)], 1
        here *= len(ranks)
    assert compute == pytest.approx([here / ep] * nproc, rel=0.05)
    assert held == pytest.approx([here / dp_shard_cp] * nproc, rel=0.05)


def degrees(overrides: list[str], nproc: int) -> tuple[int, int]:
    """(dp_shard, tp) of a layout without pipeline or context parallelism, for the expected per-rank share."""
    value = dict(zip(overrides[::2], overrides[1::2]))
    tp = int(value.get("--parallelism.tensor_parallel_degree", 1))
    replicate = int(value.get("--parallelism.data_parallel_replicate_degree", 1))
    return nproc // (tp * replicate), tp


@pytest.mark.timeout(sum(TIMEOUT_S.values()) * timeout_scale())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(layout, sessions):
    nproc, overrides, reference_name = LAYOUTS[layout]
    reference = sessions[f"reference_{reference_name}"]
    assert reference["history"][-1]["loss"] < reference["history"][0]["loss"]
    assert_same_curve(sessions[layout]["history"], reference["history"], layout)
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


# float8's casts round at the 4th bit (e4m3) and the 3rd (e5m2 gradients): a layout's sums in
# another order (TP's partial products, FSDP's reduce-scatter) move a few values across a
# rounding boundary, a step in the 4th bit each. On the first step (the same weights) that
# leaves the loss within 1e-6 and the grad norm within 2e-5 (measured 0 and 7.5e-6); each AdamW
# step then carries the flips into the weights (first steps move every weight by about lr, whatever
# the size of its gradient): measured up to 2e-5 on the loss and 1.5e-4 on the grad norm by step 5.
FLOAT8_FIRST_STEP_REL = {"loss": 1e-6, "grad_norm": 2e-5}
FLOAT8_REL = {"loss": 1e-4, "grad_norm": 1e-3}


@pytest.mark.timeout(sum(TIMEOUT_S.values()) * timeout_scale())
@pytest.mark.parametrize("layout", FLOAT8_LAYOUTS)
def test_float8_layout_matches_one_float8_process(layout, sessions):
    """The scales are the one process's (a tensorwise weight's amax over every shard: FSDP's
    float8 all-gather reduces it over the FSDP ranks, precomputed over FSDP x TP; torchao's TP
    styles over the tp ranks), so only rounding flips remain (the tolerances above). A layout
    that scaled by its own shards (FSDP x TP gathering float8 without precomputed scales)
    missed the first step's loss by 1.2e-5."""
    _, _, reference_name = FLOAT8_LAYOUTS[layout]
    history, reference = sessions[layout]["history"], sessions[f"reference_{reference_name}"]["history"]
    assert [h["step"] for h in history] == [h["step"] for h in reference]
    for step, (ours, ref) in enumerate(zip(history, reference), start=1):
        for key in ("loss", "grad_norm"):
            rel = (FLOAT8_FIRST_STEP_REL if step == 1 else FLOAT8_REL)[key]
            assert ours[key] == pytest.approx(ref[key], rel=rel), (
                f"{layout} step {step} {key}: {ours[key]} vs {ref[key]}"
            )


def test_float8_training_tracks_float32(sessions):
    """The debug model under FSDP 2 in float8 (emulated on this CPU) against the float32 run of
    the same batches: e4m3 keeps 3 mantissa bits (2**-4 relative per element at most), errors
    that largely average out over a dot product of 256 terms and over the loss's 32k tokens;
    e5m2 gradients keep 2. Measured: the loss within 6e-4 and the grad norm within 2.8e-3 over
    the 5 steps: 1e-3 and 1e-2 here. float8 is on: the curves differ."""
    float8, float32 = sessions["float8_fsdp2"]["history"], sessions["reference_causal"]["history"]
    assert float8[-1]["loss"] < float8[0]["loss"]
    for ours, ref in zip(float8, float32):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-3), (ours, ref)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2), (ours, ref)
    assert max(abs(ours["loss"] / ref["loss"] - 1) for ours, ref in zip(float8, float32)) > 1e-5


def test_float8_all_gather_gathers_float8_and_precomputed_scales_are_the_whole_weights(sessions):
    """tests/helpers/float8_checks.py on 2 ranks: with enable_fsdp_float8_all_gather FSDP gathers
    each weight as float8 (1 byte an element, a quarter of float32's) and the outputs do not
    change (the scale is the whole weight's); precompute_float8_dynamic_scale_for_fsdp leaves
    each weight the scale of the whole updated weight for its next gather, which gives the
    output the gather's own scale gives."""
    checks = sessions["float8_fsdp"]["checks"]
    elements = 64 * 64  # one whole weight
    assert checks["all_gather_False"] == [{"type": "Parameter", "dtype": "torch.float32", "bytes": 4 * elements}] * 2
    assert (
        checks["all_gather_True"]
        == [{"type": "Float8TrainingTensor", "dtype": "torch.float8_e4m3fn", "bytes": elements}] * 2
    )
    assert checks["out_difference"] == 0.0
    precompute = checks["precompute"]
    assert precompute["before"] == [None, None]
    assert max(precompute["scale_errors"]) < 1e-6
    assert precompute["out_vs_dynamic"] == 0.0


@pytest.fixture(scope="module")
def all_dimensions(tmp_path_factory) -> SessionCases:
    cases = [Case(name, [*EQUIVALENCE_ARGS, *overrides]) for name, (overrides, _) in ALL_DIMENSIONS.items()]
    results = SessionCases()
    results.add(run_session(ALL_DIMENSIONS_WORLD, cases, tmp_path_factory.mktemp("world16"), ALL_DIMENSIONS_TIMEOUT_S))
    return results


@pytest.mark.slow
@pytest.mark.timeout((ALL_DIMENSIONS_TIMEOUT_S + sum(TIMEOUT_S.values())) * timeout_scale())
@pytest.mark.parametrize("layout", ALL_DIMENSIONS)
def test_every_dimension_at_once_matches_single_process(layout, all_dimensions, sessions):
    overrides, reference_name = ALL_DIMENSIONS[layout]
    reference = sessions[f"reference_{reference_name}"]
    assert_same_curve(all_dimensions[layout]["history"], reference["history"], layout)
    if "moe_load_mean" in reference["history"][0]:
        assert [h["moe_load_max"] for h in all_dimensions[layout]["history"]] == pytest.approx(
            [h["moe_load_max"] for h in reference["history"]], rel=1e-6
        )
    if EP[0] in overrides:
        assert_expert_shares(all_dimensions[layout]["ranks"], reference["ranks"][0], overrides, ALL_DIMENSIONS_WORLD)


MUON_LAYOUTS = [name for name, (_, overrides, _) in LAYOUTS.items() if MUON[1] in overrides]


@pytest.mark.parametrize("layout", MUON_LAYOUTS)
def test_muon_orthogonalizes_each_matrix_once_on_one_rank(sessions, layout):
    """step/muon.py: every matrix (each routed expert too) is orthogonalized by exactly one
    rank, each rank takes a share, and what a rank receives is only its own matrices' blocks,
    less than the all-gather of every matrix that each rank would otherwise receive."""
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


def test_param_groups_from_a_toml_file_train_with_the_files_lr_and_decay(sessions):
    """Each group's starting lr (optimizer.lr x lr_scale) and weight decay are the file's; the
    other parameters keep optimizer.weight_decay (0.1) and optimizer.lr (3e-3); the run learns."""
    run = sessions["param_groups_toml"]
    assert run["history"][-1]["loss"] < run["history"][0]["loss"]
    groups = run["ranks"][0]["optimizer_groups"]
    assert [g["initial_lr"] for g in groups] == pytest.approx([1.5e-3, 3e-3, 3e-3])
    assert [g["weight_decay"] for g in groups] == pytest.approx([0.05, 0.0, 0.1])
    patterns = [entry.split(":")[0].split() for entry in TWO_GROUPS]
    for group, rule in zip(groups, patterns):
        assert group["params"] and all(any(fnmatch.fnmatchcase(n, p) for p in rule) for n in group["params"])
    assert "output.weight" in groups[2]["params"] and "layers.0.feed_forward.w1.weight" in groups[2]["params"]


def test_fsdp_alone_computes_with_every_expert(sessions):
    """What expert parallelism saves: FSDP all-gathers the whole expert stack for every MoE
    layer, so each rank computes with the one process's expert bytes."""
    whole = sessions["reference_qwen3_moe"]["ranks"][0]["expert_compute_bytes"]
    assert whole > 0
    assert [r["expert_compute_bytes"] for r in sessions["qwen3_moe_fsdp2"]["ranks"]] == [whole, whole]


@pytest.mark.parametrize("router", ["routed", "skewed"])
def test_one_moe_layer_split_over_ep_ranks_equals_the_whole_layer(sessions, router):
    """tests/helpers/expert_parallel_checks.py at ep 2: outputs, input and weight gradients
    as one process's; the skewed router sends every token to rank 0's experts (rank 1 sends
    and receives nothing) and no token is dropped."""
    ranks = [rank[router] for rank in sessions["expert_parallel_layer"]["checks"]["ranks"]]
    for rank in ranks:
        assert rank["local_experts"] == [4]
        assert rank["out"] < 1e-6 and rank["input_grad"] < 1e-6 and rank["weight_grads"] < 1e-6, rank
    if router == "skewed":
        assert all(rank["tokens_per_expert_here"][2:] == [0] * 6 for rank in ranks)
        assert all(sum(rank["tokens_per_expert_here"]) == 2 * 12 for rank in ranks)  # top-2 of 12 tokens each
    else:  # both ranks receive tokens: the splits are uneven, not all to one side
        assert all(sum(rank["tokens_per_expert_here"][4:]) not in (0, 24) for rank in ranks)


def test_the_split_by_flops_moves_a_block_off_the_heads_stage(sessions):
    """`pipeline_parallel_balance = "flops"` at seq 64 (the head ~1.3 blocks): pp rank 0 holds
    the embedding and blocks 0-3, where the split by layers gives it blocks 0-2."""
    by_layers = [r["full_param_bytes"] for r in sessions["pp2_1f1b"]["ranks"]]
    by_flops = [r["full_param_bytes"] for r in sessions["pp2_gpipe_balance_flops"]["ranks"]]
    moved = by_flops[0] - by_layers[0]
    assert moved > 0 and by_layers[1] - by_flops[1] == moved


def test_block_causal_differs_from_causal_where_windows_hold_several_documents(sessions):
    """The two masks train differently on packed windows (the built-in corpus packs many
    short documents into each window), so the block-causal cases above are not causal ones."""
    causal, block = sessions["reference_causal"]["history"], sessions["reference_block_causal"]["history"]
    assert abs(causal[-1]["loss"] - block[-1]["loss"]) > 1e-4


def test_the_logged_lr_is_the_one_each_step_trained_with(sessions):
    """Console, TensorBoard and metrics.jsonl take the logged value: step 1 of a 2-step warmup
    trains at half the peak, and the last step at the end of the decay (lr_factor's rule)."""
    peak, steps = 3e-3, [h["step"] for h in sessions["reference_causal"]["history"]]
    expected = [peak * lr_factor(step, len(steps), 2, None, "linear", 0.0) for step in steps]
    assert [h["lr"] for h in sessions["reference_causal"]["history"]] == pytest.approx(expected, rel=1e-12)
    assert expected[0] == peak / 2 and expected[-1] == 0.0


# --- FSDP strategies and options: what each changes (tests/helpers/fsdp_options_checks.py,
# the "fsdp_options" case of the 4-rank session). Each assertion reads what FSDP2 did, so an
# option made a no-op fails it: per-rank bytes, the parameters between forward and backward,
# whose all-gathers run in each unit's turn, the ops backward recomputes, the reductions.

SHARD = {"whole": False, "ranks": 4, "local_fraction": 0.25}  # a DTensor over all 4 ranks, a quarter here
HALF = {"whole": False, "ranks": 4, "local_fraction": 0.5}  # over 4 ranks as 2 groups of 2 (HSDP, or reshard to 2)
WHOLE = {"whole": True, "ranks": 0, "local_fraction": 1.0}  # kept unsharded


@pytest.fixture(scope="module")
def fsdp_options(sessions) -> dict:
    return sessions["fsdp_options"]["checks"]


@pytest.mark.parametrize(
    "strategy, byte_share, after_forward",
    [
        ("FULL_SHARD", 0.25, SHARD),
        ("SHARD_GRAD_OP", 0.25, WHOLE),
        ("HYBRID_SHARD", 0.5, HALF),
        ("_HYBRID_SHARD_ZERO2", 0.5, WHOLE),
        ("NO_SHARD", 1.0, WHOLE),
        ("HYBRID_SHARD_device_mesh", 0.5, HALF),
        ("hfai_fsdp_group_size_2", 0.5, HALF),
    ],
)
def test_each_sharding_strategy_trains_like_one_process_and_holds_its_share(
    fsdp_options, strategy, byte_share, after_forward
):
    """4 ranks; hybrid layouts shard over groups of 2 (fsdp_group_size=2, or a 2x2 device_mesh)."""
    result, reference = fsdp_options["strategies"][strategy], fsdp_options["reference_losses"]
    assert result["losses"] == pytest.approx(reference, rel=1e-5)
    assert result["weights_vs_reference"] < 1e-5
    assert result["byte_share"] == pytest.approx([byte_share] * 4, abs=0.01)
    assert result["after_forward"] == after_forward


@pytest.mark.parametrize(
    "case, state",
    [
        ("fsdp1_2", HALF),
        ("hfai_false", WHOLE),
        ("megatron_default", SHARD),
        ("megatron_false", WHOLE),
        ("megatron_2", HALF),
    ],
)
def test_reshard_after_forward_decides_what_stays_gathered_until_backward(fsdp_options, case, state):
    assert fsdp_options["reshard_after_forward"][case] == state


BLOCKS = [f"blocks.{i}" for i in range(4)]


def test_backward_prefetch_gathers_the_next_unit_early_and_none_turns_it_off(fsdp_options):
    prefetch = fsdp_options["prefetch"]
    one_ahead = {
        "(root)": ["(root)", "blocks.3"],
        "blocks.3": ["blocks.2"],
        "blocks.2": ["blocks.1"],
        "blocks.1": ["blocks.0"],
        "blocks.0": [],
    }
    own_only = {"(root)": ["(root)"], **{b: [b] for b in BLOCKS}}
    assert prefetch["fsdp1_default"]["backward"] == one_ahead  # BACKWARD_PRE
    assert prefetch["fsdp1_backward_none"]["backward"] == own_only
    assert prefetch["hfai_default"]["backward"] == own_only  # hfai's default is None
    assert prefetch["fsdp1_default"]["forward"] == own_only


def test_forward_prefetch_gathers_the_next_unit_in_the_current_ones_turn(fsdp_options):
    forward = fsdp_options["prefetch"]["fsdp1_forward_prefetch"]["forward"]
    assert forward == {
        "(root)": ["(root)"],
        "blocks.0": ["blocks.0", "blocks.1"],
        "blocks.1": ["blocks.2"],
        "blocks.2": ["blocks.3"],
        "blocks.3": [],
    }


def test_megatron_under_recompute_prefetches_by_module_order(fsdp_options):
    """Megatron's explicit schedule follows the modules' order; on a model that runs its
    blocks in reverse it differs from FSDP2's implicit (execution) order."""
    implicit = fsdp_options["prefetch"]["megatron_reverse"]["backward"]
    explicit = fsdp_options["prefetch"]["megatron_reverse_recompute"]["backward"]
    assert implicit["blocks.2"] == ["blocks.3"]  # the next in reverse execution
    assert explicit["blocks.2"] == ["blocks.2", "blocks.1"]  # its own, then the one before it in the model


def test_sync_module_states_starts_every_rank_from_rank_0s_weights(fsdp_options):
    result = fsdp_options["sync_module_states"]
    assert result["sync_True"]["start_vs_rank0_seed"] == 0.0
    assert result["sync_False"]["start_vs_rank0_seed"] > 1e-3  # each rank's shard of its own seed's model
    assert result["sync_True"]["losses"] == pytest.approx(fsdp_options["reference_losses"], rel=1e-5)


def test_no_sync_reduces_nothing_inside_and_the_sum_after(fsdp_options):
    result = fsdp_options["no_sync"]
    assert result["reductions_inside"] == 0 and not result["sharded_grads_set_inside"]
    assert result["reductions_after"] > 0
    assert result["grads_vs_reference"] < 1e-6  # both microbatches of every rank


def test_summon_full_params_writes_edits_back_to_every_shard_only_with_writeback(fsdp_options):
    assert fsdp_options["summon_writeback"] == {"writeback_True": True, "writeback_False": False}


def test_the_trainers_reshard_setting_decides_what_stays_gathered(fsdp_options):
    reshard = fsdp_options["trainer"]["reshard"]
    assert reshard["default"] == {"layers.0": SHARD, "layers.5": WHOLE}  # all but the last block
    assert reshard["always"] == {"layers.0": SHARD, "layers.5": SHARD}
    assert reshard["never"] == {"layers.0": WHOLE, "layers.5": WHOLE}
    assert reshard["2"] == {"layers.0": HALF, "layers.5": HALF}


def test_the_trainers_prefetch_depth_gathers_that_many_units_ahead(fsdp_options):
    prefetch = fsdp_options["trainer"]["prefetch"]
    assert prefetch["1"]["forward"]["layers.0"] == ["layers.0", "layers.1"] and prefetch["1"]["forward"][
        "layers.1"
    ] == ["layers.2"]
    assert prefetch["2"]["forward"]["layers.0"] == ["layers.0", "layers.1", "layers.2"] and prefetch["2"]["forward"][
        "layers.1"
    ] == ["layers.3"]
    assert prefetch["2"]["backward"]["layers.5"] == ["layers.4", "layers.3"] and prefetch["2"]["backward"][
        "layers.4"
    ] == ["layers.2"]


@pytest.mark.parametrize(
    "mode, silu, attention", [("none", 0, 0), ("full", 6, 6), ("selective_op", 6, 0), ("selective_2", 3, 3)]
)
def test_activation_checkpointing_recomputes_what_its_mode_says(fsdp_options, mode, silu, attention):
    """Forward ops run again in backward, over the debug model's 6 blocks: full AC reruns
    each block, per-op AC keeps attention's output and reruns the cheap SwiGLU activation,
    every-2nd-block AC reruns half the blocks."""
    assert fsdp_options["trainer"]["ac"][mode] == {"silu": silu, "attention": attention}


def test_replicate_only_keeps_whole_weights_and_all_reduces_gradients(sessions):
    """dp_replicate 2 with dp_shard 1 is composable `replicate`, not FSDP of degree 1: every
    parameter is a Replicate DTensor on dp_replicate (FSDP would show Shard(0)), each rank
    holds all of it, and the two ranks, which trained on different halves of each batch,
    end with equal weights (their gradients were all-reduced)."""
    ranks = sessions["replicate2"]["ranks"]
    for rank in ranks:
        assert rank["param_layouts"] == ["dp_replicate=R"]
        assert rank["param_bytes"] == rank["grad_bytes"] == rank["full_param_bytes"] > 0
    assert ranks[0]["local_param_sum"] == ranks[1]["local_param_sum"]
