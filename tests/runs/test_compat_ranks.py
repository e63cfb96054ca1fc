"""The compat wrappers on several gloo ranks (tests/helpers/compat_checks.py), one session per
world size. On 2 ranks: FSDP1's prefetch options under a nested wrap policy, and megatron-core's
real GPTModel under `titanlite.compat.megatron` for both `transformer_impl` values, trained by
megatron-core's own no-pipelining schedule (which calls its `finalize_model_grads` with the
schedule's arguments), against the unwrapped model. On 4 ranks:
FSDP1's `clip_grad_norm_` with an ignored module. (The wrappers' strategies and options are
checked on 4 ranks in test_parallel_equivalence.py; their documents' programs in test_examples.py.)"""

from __future__ import annotations

import pytest

from tests.helpers.sessions import Case, SessionResult, run_session

TIMEOUT_S = {2: 300, 4: 240}


def run_checks(nproc: int, names: list[str], folder) -> SessionResult:
    """Each of `names` (a function of compat_checks.py) as a case of one session on `nproc`
    ranks; a test reads its own case, so one failing case fails only its tests."""
    cases = [Case(name, [], call=f"tests.helpers.compat_checks:{name}") for name in names]
    return run_session(nproc, cases, folder, TIMEOUT_S[nproc])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> SessionResult:
    # In the test extra. Asked here, not at the module's import: importing megatron-core costs
    # ~5 s of CPU, which every test worker would pay while collecting.
    pytest.importorskip("megatron.core")
    return run_checks(2, ["fsdp1_nested_prefetch", "megatron_gpt"], tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> SessionResult:
    return run_checks(4, ["fsdp1_clip_with_ignored_modules"], tmp_path_factory.mktemp("world4"))


@pytest.mark.timeout(TIMEOUT_S[2] + 60)
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_megatron_gpt_model_trains_in_megatrons_schedule_like_the_unwrapped_model(two_ranks, impl):
    """transformer_engine is TransformerConfig's default: ColumnParallelLinear joins the units,
    except the local spec's linear_fc1, which hands its bias to its caller (skip_bias_add).
    megatron-core's schedule finalizes each step once, passing `pg_collection` (whose
    data-parallel group is the one the wrapper shards over) and `force_all_reduce`."""
    result = two_ranks["megatron_gpt"]["checks"][impl]
    layers = ["decoder.layers.0", "decoder.layers.1"]
    if impl == "local":
        assert result["units"] == ["embedding", *layers]
    else:
        qkv = [f"{layer}.self_attention.linear_qkv" for layer in layers]
        assert result["units"] == ["embedding", layers[0], qkv[0], layers[1], qkv[1], "output_layer"]
    once_a_step = [{"keywords": ["force_all_reduce", "pg_collection"], "wrapper_group": True}] * len(result["losses"])
    assert result["finalized"] == once_a_step
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
    assert result["weights_compared"] > 20 and result["weights_vs_reference"] <= 1e-5, result


@pytest.mark.timeout(TIMEOUT_S[2] + 60)
def test_fsdp1_prefetch_options_reach_every_unit_of_a_nested_wrap_policy(two_ranks):
    """Units: each block and, inside it, its mlp (pre-order: blocks.0, blocks.0.mlp, blocks.1, blocks.1.mlp)."""
    result = two_ranks["fsdp1_nested_prefetch"]["checks"]
    units = ["blocks.0", "blocks.0.mlp", "blocks.1", "blocks.1.mlp"]
    assert result["backward_none"]["backward"] == {"(root)": ["(root)"], **{u: [u] for u in units}}
    assert result["forward"]["forward"] == {
        "(root)": ["(root)"],
        "blocks.0": ["blocks.0", "blocks.0.mlp"],
        "blocks.0.mlp": ["blocks.1"],
        "blocks.1": ["blocks.1.mlp"],
        "blocks.1.mlp": [],
    }


@pytest.mark.timeout(TIMEOUT_S[4] + 60)
def test_fsdp1_clip_grad_norm_with_ignored_modules_is_fsdp1s_norm_on_every_rank(four_ranks):
    ranks = four_ranks["fsdp1_clip_with_ignored_modules"]["checks"]["ranks"]
    assert len(ranks) == 4
    for rank in ranks:
        assert rank["norm"] == pytest.approx(rank["fsdp1_norm"], rel=1e-5), ranks
        assert rank["clipped_vs_reference"] <= 1e-6, ranks
    assert len({round(r["fsdp1_norm"], 6) for r in ranks}) > 1  # each rank's own head gradient counts
