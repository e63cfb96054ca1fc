"""Checkpoints of pipeline- and context-parallel runs: exact resume at the same layout, and
resharding to and from other layouts (the stages keep every parameter's name, the sequence
split holds no state, so DCP loads a checkpoint at any layout).

On the debug model, fp32, the global batch 8: an uninterrupted 4-step run per layout saves
step 2 (and 4); each resume starts from a copy of step 2 and must log steps 3-4 (a step that
reads the restored optimizer state, and one after it)
- equal (==) to the uninterrupted run of its own layout: pp 2 and cp 2 resumed at pp 2 and cp 2;
- within 1e-6 (relative) of it when the checkpoint came from another layout: pp 2 -> 1 process,
  pp 2 -> FSDP 2 x TP 2, pp 2 -> pp 4, cp 2 -> 1 process, and the reverse, 1 process -> pp 2 and
  FSDP 2 x TP 2 -> pp 2.
The same for Qwen3-MoE's debug flavor, whose expert biases are buffers every step moves:
pp 2 resumed at pp 2 (==) and a one-process checkpoint resumed at pp 2 (1e-6); and with its
experts split by expert parallelism (each rank's experts a shard of the stacked tensor):
ep 2 resumed at ep 2 (==), ep 2 -> 1 process, FSDP 2 and ep 4, and 1 process -> ep 2 (1e-6);
ep 2 inside HSDP 2 x 2 (the experts replicated over dp_replicate) -> FSDP 2, and back; each
expert split over tp 2 (expert tensor parallelism) -> 1 process, and back.
And with Muon (its momentum buffers laid out like the weights): FSDP 2 resumed at FSDP 2 (==)
and at 1 process (1e-6).
DeepSeek-V3's debug flavor (MLA, expert bias, group-limited routing): ep 2 resumed at ep 2 (==),
and its ep 2 checkpoint resumed at pp 2 x tp 2 (1e-6).
LoRA (its checkpoints hold the adapters and their optimizer state only): FSDP 2 resumed at FSDP 2
(==) and at 1 process (1e-6).
Tied embeddings (Llama 3.2's one table for lookup and head) at FSDP 2 x TP 2, saved
asynchronously, resumed there (==; moved from test_tied_embeddings.py, which resumed 2 -> 5).
And a one-process seed checkpoint (weights of another seed) starts a pp 2 run: it trains as a
one-process run from the same seed does (1e-5), and not as from its own init. float8 (FSDP 2
gathering float8): resumed at its layout (==), its checkpoint resumed by a 1-process run without
float8 and a 1-process checkpoint resumed in float8 (within float8's distance from float32).
Runs of one world size are cases of one training session (tests/helpers/sessions.py).
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.distributed import EQUIVALENCE_ARGS, timeout_scale
from tests.helpers.sessions import Case, run_session
from tests.runs.equivalence import DSV3, FLOAT8, LORA, MUON, QWEN3_MOE

STEPS = 4
SAVED = 2  # the step every resume starts from
ARGS = [
    *EQUIVALENCE_ARGS,
    "--training.steps",
    str(STEPS),
    # Constant lr after warmup: a resumed run follows the same schedule as the uninterrupted one.
    "--lr_scheduler.decay_ratio",
    "0",
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    str(SAVED),
    "--checkpoint.keep_latest_k",
    "0",
]
EP = "--parallelism.expert_parallel_degree"
LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "pp2": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    "fsdp2_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "pp4": (4, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "4"]),
    "moe_single": (1, ["--training.local_batch_size", "8", *QWEN3_MOE]),
    "moe_pp2": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2", *QWEN3_MOE]),
    "moe_ep2": (2, ["--training.local_batch_size", "4", EP, "2", *QWEN3_MOE]),
    "moe_fsdp2": (2, ["--training.local_batch_size", "4", *QWEN3_MOE]),
    "moe_ep4": (4, ["--training.local_batch_size", "2", EP, "4", *QWEN3_MOE]),
    "muon_single": (1, ["--training.local_batch_size", "8", *MUON]),
    "muon_fsdp2": (2, ["--training.local_batch_size", "4", *MUON]),
    "moe_etp2_tp2": (
        2,
        [
            *("--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"),
            *("--parallelism.expert_tensor_parallel_degree", "2", *QWEN3_MOE),
        ],
    ),
    "moe_ep2_hsdp2x2": (
        4,
        ["--training.local_batch_size", "2", EP, "2", "--parallelism.data_parallel_replicate_degree", "2", *QWEN3_MOE],
    ),
    "float8_fsdp2": (2, ["--training.local_batch_size", "4", *FLOAT8]),
    # LoRA saving its adapters only: the frozen weights come from the seeded init again on resume.
    "lora_single": (1, ["--training.local_batch_size", "8", *LORA]),
    "lora_fsdp2": (2, ["--training.local_batch_size", "4", *LORA]),
    "dsv3_ep2": (2, ["--training.local_batch_size", "4", EP, "2", *DSV3]),
    # Tied embeddings (one table for lookup and head) under FSDP 2 x TP 2, saved asynchronously.
    "tied_fsdp2_tp2": (
        4,
        [
            *("--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"),
            *("--model.flavor", "debugmodel_tied", "--checkpoint.async_mode", "async"),
        ],
    ),
    "dsv3_pp2_tp2": (
        4,
        [
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            *DSV3,
        ],
    ),
}
# resume case: (layout it runs at, layout whose step-2 checkpoint it starts from)
RESUMES = {
    "pp2_from_pp2": ("pp2", "pp2"),
    "cp2_from_cp2": ("cp2", "cp2"),
    "single_from_pp2": ("single", "pp2"),
    "fsdp2_tp2_from_pp2": ("fsdp2_tp2", "pp2"),
    "single_from_cp2": ("single", "cp2"),
    "pp2_from_single": ("pp2", "single"),
    "pp2_from_fsdp2_tp2": ("pp2", "fsdp2_tp2"),
    "pp4_from_pp2": ("pp4", "pp2"),
    "moe_pp2_from_moe_pp2": ("moe_pp2", "moe_pp2"),
    "moe_pp2_from_moe_single": ("moe_pp2", "moe_single"),
    "moe_ep2_from_moe_ep2": ("moe_ep2", "moe_ep2"),
    "moe_single_from_moe_ep2": ("moe_single", "moe_ep2"),
    "moe_fsdp2_from_moe_ep2": ("moe_fsdp2", "moe_ep2"),
    "moe_ep4_from_moe_ep2": ("moe_ep4", "moe_ep2"),
    "moe_ep2_from_moe_single": ("moe_ep2", "moe_single"),
    "muon_fsdp2_from_muon_fsdp2": ("muon_fsdp2", "muon_fsdp2"),
    "muon_single_from_muon_fsdp2": ("muon_single", "muon_fsdp2"),
    "moe_fsdp2_from_moe_ep2_hsdp2x2": ("moe_fsdp2", "moe_ep2_hsdp2x2"),
    "moe_ep2_hsdp2x2_from_moe_fsdp2": ("moe_ep2_hsdp2x2", "moe_fsdp2"),
    "moe_single_from_moe_etp2_tp2": ("moe_single", "moe_etp2_tp2"),
    "moe_etp2_tp2_from_moe_single": ("moe_etp2_tp2", "moe_single"),
    "float8_fsdp2_from_float8_fsdp2": ("float8_fsdp2", "float8_fsdp2"),
    "dsv3_ep2_from_dsv3_ep2": ("dsv3_ep2", "dsv3_ep2"),
    "dsv3_pp2_tp2_from_dsv3_ep2": ("dsv3_pp2_tp2", "dsv3_ep2"),
    "tied_fsdp2_tp2_from_tied_fsdp2_tp2": ("tied_fsdp2_tp2", "tied_fsdp2_tp2"),
    "lora_fsdp2_from_lora_fsdp2": ("lora_fsdp2", "lora_fsdp2"),
    "lora_single_from_lora_fsdp2": ("lora_single", "lora_fsdp2"),
}
# A float8 checkpoint holds the high-precision weights under their usual names: it resumes a
# run without float8, and a float8 run resumes from a checkpoint without it.
FLOAT8_RESUMES = {
    "single_from_float8_fsdp2": ("single", "float8_fsdp2"),
    "float8_fsdp2_from_single": ("float8_fsdp2", "single"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """name -> logged history, for every uninterrupted run and every resume. Sessions in the
    order the checkpoints are needed: 1 and 4 processes save, 2 processes save and resume,
    then 1 and 4 processes resume from the 2-process checkpoints."""
    root = tmp_path_factory.mktemp("resume")
    histories: dict[str, list[dict]] = {}

    def uninterrupted(layout: str) -> Case:
        return Case(layout, [*ARGS, *LAYOUTS[layout][1]])

    def resume(name: str) -> Case:
        layout, source = {**RESUMES, **FLOAT8_RESUMES}[name]
        return Case(
            name,
            [*ARGS, *LAYOUTS[layout][1]],
            copy_checkpoint=(str(root / f"world{LAYOUTS[source][0]}" / source), SAVED),
        )

    seed = Case(
        "seed", [*ARGS, *LAYOUTS["single"][1], "--checkpoint.create_seed_checkpoint", "true", "--training.seed", "7"]
    )

    def from_seed(layout: str) -> Case:
        return Case(
            f"{layout}_from_seed", [*ARGS, *LAYOUTS[layout][1]], copy_checkpoint=(str(root / "world1" / "seed"), 0)
        )

    plan = [
        (
            1,
            [
                uninterrupted("single"),
                seed,
                uninterrupted("moe_single"),
                uninterrupted("muon_single"),
                uninterrupted("lora_single"),
            ],
        ),
        (
            4,
            [
                uninterrupted("fsdp2_tp2"),
                uninterrupted("pp4"),
                uninterrupted("moe_ep4"),
                uninterrupted("moe_ep2_hsdp2x2"),
                uninterrupted("dsv3_pp2_tp2"),
                uninterrupted("tied_fsdp2_tp2"),
            ],
        ),
        (
            2,
            [
                uninterrupted("pp2"),
                uninterrupted("cp2"),
                uninterrupted("moe_pp2"),
                uninterrupted("moe_ep2"),
                uninterrupted("moe_fsdp2"),
                uninterrupted("muon_fsdp2"),
                uninterrupted("moe_etp2_tp2"),
                uninterrupted("float8_fsdp2"),
                uninterrupted("dsv3_ep2"),
                uninterrupted("lora_fsdp2"),
                from_seed("pp2"),
                *[resume(n) for n, (at, _) in {**RESUMES, **FLOAT8_RESUMES}.items() if LAYOUTS[at][0] == 2],
            ],
        ),
        (
            1,
            [
                from_seed("single"),
                *[resume(n) for n, (at, _) in {**RESUMES, **FLOAT8_RESUMES}.items() if LAYOUTS[at][0] == 1],
            ],
        ),
        (4, [resume(n) for n, (at, _) in RESUMES.items() if LAYOUTS[at][0] == 4]),
    ]
    for nproc, cases in plan:
        session = run_session(nproc, cases, root / f"world{nproc}", timeout=600)
        histories.update({case.name: session[case.name]["history"] for case in cases})
    # The histories are all the tests read: the ~7 GB of checkpoints go now, not at the end of
    # the suite (the logs stay).
    for folder in root.glob("world*/*/checkpoint"):
        shutil.rmtree(folder)
    return histories


@pytest.mark.timeout(1500 * timeout_scale())
@pytest.mark.parametrize("name", RESUMES)
def test_resume_continues_the_uninterrupted_run(runs, name):
    layout, source = RESUMES[name]
    resumed, straight = runs[name], runs[layout]
    assert [h["step"] for h in resumed] == list(range(SAVED + 1, STEPS + 1))
    for ours, ref in zip(resumed, straight[SAVED:]):
        if layout == source:  # the same layout: exactly the same numbers
            assert (ours["loss"], ours["grad_norm"]) == (ref["loss"], ref["grad_norm"]), (name, ours, ref)
        else:
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-6), (name, ours, ref)
            assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (name, ours, ref)


@pytest.mark.parametrize("name", FLOAT8_RESUMES)
def test_a_float8_checkpoint_resumes_without_float8_and_back(runs, name):
    """Steps 3-4 continue from the step-2 weights: within float8's distance from float32
    (tests/runs/test_parallel_equivalence.py: 1e-3 on the loss) of both uninterrupted runs,
    the one the checkpoint came from and the one the resume trains like; a run that had
    started afresh would log the first step's loss (about 8.9 against 7.9 at step 3 here)."""
    layout, source = FLOAT8_RESUMES[name]
    resumed = runs[name]
    assert [h["step"] for h in resumed] == list(range(SAVED + 1, STEPS + 1))
    for uninterrupted in (runs[layout], runs[source]):
        for ours, ref in zip(resumed, uninterrupted[SAVED:]):
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-3), (name, ours, ref)


def test_a_pipeline_starts_from_a_one_process_seed_checkpoint(runs):
    seeded, single_seeded, own_init = runs["pp2_from_seed"], runs["single_from_seed"], runs["pp2"]
    assert abs(seeded[0]["loss"] - own_init[0]["loss"]) > 1e-4  # the seed's weights, not pp 2's own init
    for ours, ref in zip(seeded, single_seeded):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5) and ours["grad_norm"] == pytest.approx(
            ref["grad_norm"], rel=1e-5
        )
