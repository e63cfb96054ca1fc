"""Every parallel layout of 4 processes trains exactly like one process (tests/runs/equivalence.py
says what and how), and every FSDP strategy and option shows its effect (the last section).
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import assert_same_curve, timeout_scale
from tests.helpers.sessions import Case, SessionCases
from tests.runs.equivalence import (
    COMPILED,
    FLOAT8_LAYOUTS,
    LORA_LAYOUTS,
    LAYOUTS,
    MUON,
    TIMEOUT_S,
    layouts_of,
    run_sessions,
)
from tests.runs.equivalence_checks import (
    check_float8_layout,
    check_lora_layout,
    check_gpt2_tp,
    check_layout,
    check_muon,
)

WORLD = 4


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> SessionCases:
    fsdp = Case("fsdp_options", [], call="tests.helpers.fsdp_options_checks:run_checks")
    return run_sessions(tmp_path_factory, {WORLD: [fsdp, COMPILED]})


@pytest.mark.timeout(sum(TIMEOUT_S.values()) * timeout_scale())
@pytest.mark.parametrize("layout", layouts_of(WORLD, LAYOUTS))
def test_layout_matches_single_process(layout, sessions):
    check_layout(layout, sessions)


@pytest.mark.timeout(sum(TIMEOUT_S.values()) * timeout_scale())
@pytest.mark.parametrize("layout", layouts_of(WORLD, LORA_LAYOUTS))
def test_lora_layout_matches_one_lora_process(layout, sessions):
    check_lora_layout(layout, sessions)


@pytest.mark.timeout(sum(TIMEOUT_S.values()) * timeout_scale())
@pytest.mark.parametrize("layout", layouts_of(WORLD, FLOAT8_LAYOUTS))
def test_float8_layout_matches_one_float8_process(layout, sessions):
    """The scales are the one process's (a tensorwise weight's amax over every shard: FSDP's
    float8 all-gather reduces it over the FSDP ranks, precomputed over FSDP x TP; torchao's TP
    styles over the tp ranks), so only rounding flips remain (the tolerances above). A layout
    that scaled by its own shards (FSDP x TP gathering float8 without precomputed scales)
    missed the first step's loss by 1.2e-5."""
    check_float8_layout(layout, sessions)


@pytest.mark.parametrize("layout", [name for name in layouts_of(WORLD, LAYOUTS) if MUON[1] in LAYOUTS[name][1]])
def test_muon_orthogonalizes_each_matrix_once_on_one_rank(sessions, layout):
    """step/muon.py: every matrix (each routed expert too) is orthogonalized by exactly one
    rank, each rank takes a share, and what a rank receives is only its own matrices' blocks,
    less than the all-gather of every matrix that each rank would otherwise receive."""
    check_muon(layout, sessions)


def test_gpt2_fsdp2_tp2_matches_one_process(sessions):
    """GPT-2's TP plan under FSDP (moved from test_gpt2.py: test_trainer_tp_layouts_match_one_process[fsdp2_tp2])."""
    check_gpt2_tp("gpt2_fsdp2_tp2", sessions)


def test_tied_fsdp_tp_matches_single_process(sessions):
    """Tied embeddings (one table for lookup and head, as Llama 3.2 has) under the TP plan
    with FSDP (moved from test_tied_embeddings.py)."""
    reference = sessions["reference_tied"]
    assert reference["history"][-1]["loss"] < reference["history"][0]["loss"]
    assert_same_curve(sessions["tied_fsdp2_tp2"]["history"], reference["history"], "tied fsdp2_tp2")


def test_compiled_fsdp_tp_matches_eager_single_process(sessions):
    """torch.compile per block through the real trainer: FSDP 2 x TP 2 with compiled blocks
    (DTensor inside the graphs, FSDP hooks outside) against the 1-process eager reference, to
    the layout tests' 1e-5 (moved from test_compile.py; its in-process test stays there)."""
    assert_same_curve(sessions[COMPILED.name]["history"], sessions["reference_causal"]["history"], "fsdp2_tp2 compiled")


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
