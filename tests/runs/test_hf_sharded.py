"""A Hugging Face model as transformers saves it (several safetensors files), loaded into a
sharded titanlite model on real gloo groups, and written back by those ranks.

transformers' `save_pretrained` with a small `max_shard_size` is the source. It loads at 1
process, FSDP 2, TP 2 (2 processes), FSDP 2 x TP 2 and FSDP 4 (4 processes; there wk's
shard is half a head, the case where the RoPE rows of one shard come from two places), each
with logits equal to transformers' to 1e-4, through the trainer's own restore path. Each
layout then saves its model with `hf_io.save_hf_weights` (every rank its own shards, then
consolidated), and transformers loads every one of those folders with the same logits.
Qwen3, Qwen3-MoE and DeepSeek-V3 (low-rank queries, YaRN, group-limited MoE with an expert
bias) do the same at FSDP 2 in the same processes (each rank reads and writes its own
experts, one HF tensor each), and Qwen3-MoE and DeepSeek-V3 (its debug flavor: plain
queries) trainer runs at FSDP 2 and at expert parallelism 2 (each rank holding half the
experts) start from a Hugging Face folder and end with `last_save_in_hf` beside the Llama
runs, and so does a tiny transformers Gemma 3 trained as `--model.name hf` at FSDP 2 (whose
greedy `titanlite.generate` text is transformers' greedy text of the export).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_models
from tests.helpers.gloo_llama import ARGS, build, checkpoint_cfg, full_logits, init_gloo, manager_for, spawn
from tests.helpers import hf_deepseek_v3, hf_gpt_oss
from tests.helpers.hf_qwen3 import SMALL_FILES, TINY, hf_logits, save_source, transformers_model
from tests.helpers.distributed import REPO, run_env
from titanlite.checkpoint import hf_io
from titanlite.data.tokenizers import Tokenizer
from titanlite.models.hf.model import HFCausalLM, read_hf_args
from titanlite.models.llama import llama3_hf as hf_adapter
from titanlite.models.llama.model import Llama, LlamaArgs

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """transformers' random tiny Llama of ARGS' shapes, saved in several files, with its
    logits on fixed tokens (reference.pt); and the tiny Qwen3, Qwen3-MoE and DeepSeek-V3 (low-rank
    queries) alike in the subfolders qwen3/, qwen3_moe/ and deepseek_v3/."""
    folder = tmp_path_factory.mktemp("hf-source")
    args = LlamaArgs(**ARGS)
    torch.manual_seed(0)
    config = transformers.LlamaConfig.from_dict(hf_adapter.hf_config(args))
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder / "hf", max_shard_size=SMALL_FILES)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save({"tokens": tokens, "logits": model(tokens).logits}, folder / "reference.pt")
    for kind, qwen3_args in TINY.items():
        (folder / kind).mkdir()
        save_source(qwen3_args, folder / kind)
    (folder / "deepseek_v3").mkdir()
    hf_deepseek_v3.save_source(hf_deepseek_v3.TINY["q_lora"], folder / "deepseek_v3")
    return folder


def _model(kind: str):
    """(spec, args) of a source: the tiny Llama, or a tiny Qwen3 of tests/helpers/hf_qwen3.py,
    or the tiny DeepSeek-V3 with low-rank queries of tests/helpers/hf_deepseek_v3.py."""
    from titanlite.models import get_model_spec

    if kind == "deepseek_v3":
        return get_model_spec("deepseek_v3"), hf_deepseek_v3.TINY["q_lora"]
    return (None, None) if kind == "llama" else (get_model_spec("qwen3"), TINY[kind])


def load_and_save_worker(rank: int, world: int, port: int, folder: str, layouts: list[tuple[str, int, int]]) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    init_gloo(rank, world, port)
    for kind, dp, tp in layouts:
        source = Path(folder) / ("" if kind == "llama" else kind)
        reference = torch.load(source / "reference.pt")
        spec, args = _model(kind)
        args, model = build(dp, tp, seed=7, spec=spec, args=args)
        cfg = checkpoint_cfg(enable_checkpoint=False, initial_load_path=str(source / "hf"), initial_load_format="hf")
        manager = manager_for(cfg, source / f"run-{dp}x{tp}", args, model, spec=spec)
        manager.load()
        with torch.no_grad():
            logits = full_logits(model, reference["tokens"])
        torch.testing.assert_close(
            logits, reference["logits"], rtol=1e-4, atol=1e-4, msg=lambda m: f"{kind} fsdp {dp} x tp {tp}: {m}"
        )
        adapter = hf_adapter if spec is None else spec.hf_adapter
        hf_io.save_hf_weights(
            get_model_state_dict(model),
            source / f"saved-{dp}x{tp}",
            adapter,
            args,
            dist.group.WORLD,
            max_file_bytes=SMALL_FILES,
        )
        manager.close()
    dist.barrier()
    dist.destroy_process_group()


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def check_saved(folder: Path, name: str) -> None:
    """A folder the ranks wrote: several whole files, the source's tensor names (each
    expert its own), and transformers' logits of the source."""
    saved = folder / name
    files = set(weight_map(saved).values())
    assert len(files) > 2 and all((saved / f).is_file() for f in files), sorted(p.name for p in saved.iterdir())
    assert not list(folder.glob("*.partial")) and not (saved / "sharded").exists()
    assert weight_map(saved).keys() == weight_map(folder / "hf").keys()
    reference = torch.load(folder / "reference.pt")
    torch.testing.assert_close(hf_logits(saved, reference["tokens"]), reference["logits"], rtol=1e-4, atol=1e-4)


def test_transformers_folder_loads_at_one_process_and_saves_back(source):
    files = set(json.loads((source / "hf" / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(files) > 2  # the source really is sharded
    args = LlamaArgs(**ARGS)
    model = Llama(args)
    model.init_weights(seed=7)  # the RoPE table; the weights come next
    model.load_state_dict(hf_io.read_hf_model(source / "hf", hf_adapter, args, Llama))
    reference = torch.load(source / "reference.pt")
    with torch.no_grad():
        torch.testing.assert_close(model(reference["tokens"]), reference["logits"], rtol=1e-4, atol=1e-4)
    hf_io.save_hf_weights(model.state_dict(), source / "saved-1x1", hf_adapter, args, max_file_bytes=SMALL_FILES)
    check_saved(source, "saved-1x1")


@pytest.mark.timeout(300)
def test_fsdp2_and_tp2_load_and_save(source):
    """Llama at FSDP 2 and TP 2, Qwen3 and Qwen3-MoE at FSDP 2 (2 and 1 of its 3 experts a rank),
    DeepSeek-V3 at FSDP 2 (4 of its 8 experts a rank, the expert bias replicated)."""
    spawn(
        load_and_save_worker,
        2,
        str(source),
        [("llama", 2, 1), ("llama", 1, 2), ("qwen3", 2, 1), ("qwen3_moe", 2, 1), ("deepseek_v3", 2, 1)],
        timeout=240,
    )
    for name in ("saved-2x1", "saved-1x2"):
        check_saved(source, name)
    for kind in [*TINY, "deepseek_v3"]:
        check_saved(source / kind, "saved-2x1")


@pytest.mark.timeout(300)
def test_fsdp2_x_tp2_and_fsdp4_load_and_save(source):
    """Llama at FSDP 2 x TP 2 and FSDP 4; Qwen3-MoE at FSDP 4, more ranks than its 3 experts:
    each rank holds rows of every expert (fsdp.shard_dim), read and written as blocks of the
    per-expert HF tensors."""
    spawn(load_and_save_worker, 4, str(source), [("llama", 2, 2), ("llama", 4, 1), ("qwen3_moe", 4, 1)], timeout=240)
    for name in ("saved-2x2", "saved-4x1"):
        check_saved(source, name)
    check_saved(source / "qwen3_moe", "saved-4x1")


# The MoE families of the trainer session: the run's name prefix, its model flags, and the
# helper module that builds transformers' model of a flavor's args.
MOE_RUNS = {
    "qwen3_moe": (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_aux"], transformers_model),
    "deepseek_v3": (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"], hf_deepseek_v3.transformers_model),
    # sinks, windows (32 of 64 tokens), biases, the experts stacked in HF's own layout
    "gpt_oss": (["--model.name", "gpt_oss", "--model.flavor", "debugmodel"], hf_gpt_oss.transformers_model),
}


@pytest.mark.timeout(420)
def test_pipeline_and_fsdp_runs_start_from_hf_and_write_it_back(tmp_path):
    """Trainer runs of the debug model at PP 2 and at FSDP 2 start from the same Hugging
    Face folder (several files) and end with `last_save_in_hf`: each pipeline stage reads and
    writes only its own layers. Both train the same curve (1e-5), and their two HF outputs are
    the same model to transformers. In the same session, Qwen3-MoE (its debug flavor without
    an expert bias) and DeepSeek-V3 (its debug flavor: group-limited routing, the expert bias
    as e_score_correction_bias) each at FSDP 2 and at ep 2, with the default parameter groups,
    start from transformers' folder and end with one of the same tensor names (each expert its
    own), which transformers reads as the run's last checkpoint; ep 2 trains the FSDP 2 curve
    bit for bit and writes the same model.

    Bit for bit, not within 1e-5: when ep ran each local expert over every source rank's rows
    at once (other matmul shapes, each weight gradient summed in another order), the rounding
    differences of step 1 grew, from transformers' init (std 0.02) at lr 3e-3, to 1e-6 - 2.5e-5
    in the grad norm by step 4 (seeds 0-2, with or without parameter groups). One MoE layer
    shows the cause: ep 2 against each rank computing its own tokens, the weight gradients
    summed (`own_ranks`, test_parallel_equivalence.py), 0.0 now."""
    from tests.helpers.distributed import EQUIVALENCE_ARGS, assert_same_curve
    from tests.helpers.sessions import Case, run_session
    from tests.runs.equivalence import LORA, TP
    from titanlite.build import plan_run
    from titanlite.checkpoint import export
    from titanlite.config.load import load_config
    from titanlite.models import get_model_spec

    args = plan_run(load_config(EQUIVALENCE_ARGS), 1).model_args
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(hf_adapter.hf_config(args)))
    model.save_pretrained(tmp_path / "hf", max_shard_size=2 * 1024**2)
    # 5 steps, not EQUIVALENCE_ARGS' 3: the pp 2 and FSDP 2 models are compared logit by logit
    # within 1e-5, and after 2 updates (3 steps) a few dozen logits of 262,144 differed by up to 2.6e-5
    # (AdamW's first updates move a weight by about lr whatever its gradient's size).
    hf_steps = "5"
    start = [
        "--checkpoint.initial_load_format",
        "hf",
        "--checkpoint.last_save_in_hf",
        "true",
        "--training.steps",
        hf_steps,
    ]
    cases = [
        Case(
            "pp2",
            [
                *EQUIVALENCE_ARGS,
                *start,
                "--checkpoint.initial_load_path",
                str(tmp_path / "hf"),
                "--training.local_batch_size",
                "8",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ],
        ),
        Case(
            "fsdp2",
            [
                *EQUIVALENCE_ARGS,
                *start,
                "--checkpoint.initial_load_path",
                str(tmp_path / "hf"),
                "--training.local_batch_size",
                "4",
            ],
        ),
    ]
    # LoRA from the same folder (tests/runs/equivalence.py's adapters on wq and wo): merged into the
    # weights at FSDP 2, and as a PEFT adapter folder at TP 2 (the two layouts train one curve).
    lora_layouts = {
        "lora_merged_fsdp2": ["--training.local_batch_size", "4", "--lora.save", "merged"],
        "lora_adapters_tp2": ["--training.local_batch_size", "8", *TP],
    }
    for name, layout in lora_layouts.items():
        from_llama = [*EQUIVALENCE_ARGS, *start, "--checkpoint.initial_load_path", str(tmp_path / "hf")]
        cases.append(Case(name, [*from_llama, *LORA, *layout]))
    moe_models = {}
    for family, (flags, make_transformers_model) in MOE_RUNS.items():
        moe_args = plan_run(load_config([*EQUIVALENCE_ARGS, *flags]), 1).model_args
        moe_models[family] = (moe_args, make_transformers_model(moe_args, std=0.02))
        moe_models[family][1].save_pretrained(tmp_path / f"hf_{family}", max_shard_size=2 * 1024**2)
        from_hf = [*EQUIVALENCE_ARGS, *flags, *start, "--checkpoint.initial_load_path", str(tmp_path / f"hf_{family}")]
        cases += [
            Case(
                f"{family}_fsdp2",
                [
                    *from_hf,
                    "--training.local_batch_size",
                    "4",
                    "--checkpoint.enable_checkpoint",
                    "true",
                    "--checkpoint.interval",
                    hf_steps,
                    "--checkpoint.async_mode",
                    "disabled",
                ],
            ),
            Case(
                f"{family}_ep2",
                [*from_hf, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
            ),
        ]
    # `--model.name hf`: a tiny transformers Gemma 3 (tied head, sliding-window layers) from its own
    # folder at FSDP 2, and a Qwen3-MoE (titanlite's MoE layer in its blocks) at ep 2, each rank
    # reading and writing its own experts.
    backends = {"hf_backend_fsdp2": ("gemma3_text", "4"), "hf_backend_moe_ep2": ("qwen3_moe", "4")}
    backend_sources = {}
    for name, (model_type, batch) in backends.items():
        folder = hf_models.hf_folder(tmp_path, model_type)
        torch.manual_seed(0)
        backend_sources[name] = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(folder)
        )
        backend_sources[name].save_pretrained(folder)
        ep = ["--parallelism.expert_parallel_degree", "2"] if "ep2" in name else []
        cases.append(
            Case(
                name,
                [
                    *EQUIVALENCE_ARGS,
                    *(
                        "--model.name",
                        "hf",
                        "--model.hf_assets_path",
                        str(folder),
                        "--training.local_batch_size",
                        batch,
                    ),
                    *(*start, "--checkpoint.initial_load_path", str(folder), "--checkpoint.enable_checkpoint", "true"),
                    *("--checkpoint.interval", hf_steps, "--checkpoint.async_mode", "disabled", *ep),
                ],
            )
        )
    backend = hf_models.hf_folder(tmp_path, "gemma3_text")
    session = run_session(2, cases, tmp_path / "runs", 360)
    assert_same_curve(session["pp2"]["history"], session["fsdp2"]["history"], "pp2 vs fsdp2")
    steps = session["fsdp2"]["history"][-1]["step"]
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    saved = {name: tmp_path / "runs" / name / "checkpoint" / f"step-{steps}-hf" for name in ("pp2", "fsdp2")}
    for folder in saved.values():  # every tensor, from whichever stage held it
        assert (
            json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].keys()
            == model.state_dict().keys()
        )
    logits = {name: hf_logits(folder, tokens) for name, folder in saved.items()}
    torch.testing.assert_close(logits["pp2"], logits["fsdp2"], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(logits["fsdp2"], model(tokens).logits, atol=1e-3)  # trained since the start

    # The merged folder is a plain Llama for transformers; PEFT puts the TP run's adapters on the source folder.
    lora_runs = {
        name: tmp_path / "runs" / name / "checkpoint" / f"step-{steps}-hf"
        for name in ("lora_merged_fsdp2", "lora_adapters_tp2")
    }
    assert weight_map(lora_runs["lora_merged_fsdp2"]).keys() == model.state_dict().keys()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, lora_runs["lora_adapters_tp2"])(tokens).logits
        merged = hf_logits(lora_runs["lora_merged_fsdp2"], tokens)
        torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged, model(tokens).logits, atol=1e-3)  # the adapters trained

    for family, (moe_args, moe_model) in moe_models.items():
        assert session[f"{family}_fsdp2"]["history"][-1]["step"] == steps
        moe_run = tmp_path / "runs" / f"{family}_fsdp2" / "checkpoint"
        assert weight_map(moe_run / f"step-{steps}-hf").keys() == weight_map(tmp_path / f"hf_{family}").keys()
        ours = get_model_spec(MOE_RUNS[family][0][1]).model_class(moe_args)
        ours.init_weights(seed=0)  # the RoPE table; the weights come next
        ours.load_state_dict(export.read_dcp_model(moe_run / f"step-{steps}"))
        theirs = hf_logits(moe_run / f"step-{steps}-hf", tokens)
        with torch.no_grad():
            torch.testing.assert_close(
                theirs, ours.eval()(tokens), rtol=1e-4, atol=1e-4, msg=lambda m, f=family: f"{f}: {m}"
            )
            assert not torch.allclose(theirs, moe_model(tokens).logits, atol=1e-3)  # trained since the start
        # At ep 2 each rank read and wrote its own 4 experts: the same curve, the same model.
        ep2, fsdp2 = session[f"{family}_ep2"]["history"], session[f"{family}_fsdp2"]["history"]
        assert_same_curve(ep2, fsdp2, f"{family} ep2 vs fsdp2", rel=0.0)
        ep_folder = tmp_path / "runs" / f"{family}_ep2" / "checkpoint" / f"step-{steps}-hf"
        assert weight_map(ep_folder).keys() == weight_map(tmp_path / f"hf_{family}").keys()
        torch.testing.assert_close(
            hf_logits(ep_folder, tokens), theirs, rtol=1e-4, atol=1e-4, msg=lambda m, f=family: f"{f}: {m}"
        )

    # The HF backend's exports: transformers' own names, read by transformers as the run's last checkpoint.
    for name, (model_type, _) in backends.items():
        backend_run = tmp_path / "runs" / name / "checkpoint"
        assert session[name]["history"][-1]["step"] == steps
        ours = HFCausalLM(read_hf_args(str(hf_models.hf_folder(tmp_path, model_type))))
        ours.load_state_dict(export.read_dcp_model(backend_run / f"step-{steps}"))
        theirs = hf_logits(backend_run / f"step-{steps}-hf", tokens)
        with torch.no_grad():
            torch.testing.assert_close(
                theirs, ours.eval()(tokens), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
            assert not torch.allclose(
                theirs, backend_sources[name](tokens).logits, atol=1e-3
            )  # trained since the start
    # Greedy `titanlite.generate` on the Gemma run's checkpoint prints transformers' greedy text of its export.
    backend_run = tmp_path / "runs" / "hf_backend_fsdp2" / "checkpoint"
    prompt, tokenizer = "The quick brown", Tokenizer(str(backend / "tokenizer.model"))
    command = ["--checkpoint", str(backend_run), "--prompt", prompt, "--max-new-tokens", "8", "--config", "debug_model"]
    command += [
        "--model.name",
        "hf",
        "--model.hf_assets_path",
        str(backend),
        "--training.mixed_precision_param",
        "float32",
    ]
    printed = subprocess.run(
        [sys.executable, "-m", "titanlite.generate", *command], cwd=REPO, env=run_env(), capture_output=True, text=True
    )
    assert printed.returncode == 0, printed.stderr[-2000:]
    exported = transformers.AutoModelForCausalLM.from_pretrained(backend_run / f"step-{steps}-hf")
    ids = torch.tensor([tokenizer.encode(prompt, eos=False)])
    greedy = exported.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert printed.stdout.splitlines()[-1] == tokenizer.decode(greedy[0])
