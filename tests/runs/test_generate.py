"""`python -m titanlite.generate` on a checkpoint the real trainer wrote (debug model, 4 steps,
fp32, CPU, one process), and on a Hugging Face folder transformers wrote:

- greedy text of a batch of prompts of different lengths is, for each prompt, the
  continuation this test computes itself from the checkpoint's weights by recomputing the
  whole sequence for every token (argmax of the model's own logits, each prompt alone):
  with the KV cache, without it (`--no-kv-cache`), from a prompt file, at tensor parallel
  2 and under FSDP over 2 ranks; and for GPT-2, which has no KV cache;
- seeded top-k sampling gives each prompt the text it gets alone, the same text through 2
  pipeline ranks holding 2 stages each (the output is on rank 1, which samples), and
  another seed another text;
- the log lines say the compute dtype and the tokens/s; only rank 0 prints;
- bad input is one `titanlite: error:` line and exit code 2, and a checkpoint of another
  flavor is refused as a resume refuses it;
- from a Hugging Face folder, the first token is the argmax of transformers' own logits
  (Llama), and the whole greedy text is transformers' greedy text (Qwen3, Qwen3-MoE,
  DeepSeek-V3).

The one-process runs share one interpreter (`run_mains`), and each layout is one launch
that decodes the whole batch, to keep the test time small.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.commands import assert_one_line_user_error, run_command
from tests.helpers.distributed import REPO, run_env, run_mains, run_ranks
from titanlite.data.tokenizers import Tokenizer

pytestmark = pytest.mark.slow

TIMEOUT = 120
# Of 2, 5 and 9 tokens with the beginning-of-text one: the first forward takes 2 from each,
# and the longer prompts are fed their own tokens while the shortest generates.
PROMPTS = ["A", "The Python language", "Lists and dictionaries are"]
PROMPT = PROMPTS[1]
NEW_TOKENS = 8
CONFIG = ["--config", "debug_model", "--training.mixed_precision_param", "float32"]
TRAIN = [
    *CONFIG,
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "4",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.peak_flops",
    "1e11",  # no start-up matmul measurement
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    "2",  # step-2 and step-4: generate must take the newest
    "--checkpoint.async_mode",
    "disabled",
]
SAMPLE = ["--temperature", "0.8", "--top-k", "5"]
# Pipeline: 4 stages on 2 ranks (rank r holds stages r and r + 2), so every step's
# activations cross ranks three times and the output sits on rank 1.
PIPELINE = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "Interleaved1F1B",
]


def _env() -> dict[str, str]:
    return {**run_env(), "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU even on a GPU machine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The checkpoint folder of a 4-step training run (steps 2 and 4 saved)."""
    dump = tmp_path_factory.mktemp("generate")
    result = run_ranks(1, ["-m", "titanlite.train"], [*TRAIN, "--job.dump_folder", str(dump)], TIMEOUT, env=_env())
    assert result.returncode == 0, f"trainer failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return dump / "checkpoint"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(REPO / "assets" / "tokenizer" / "titanlite.model"))


def argv_for(folder: Path, *args: str, prompts: list[str] = PROMPTS, new_tokens: int = NEW_TOKENS) -> list[str]:
    return [
        *CONFIG,
        "--checkpoint",
        str(folder),
        *[w for p in prompts for w in ("--prompt", p)],
        "--max-new-tokens",
        str(new_tokens),
        *args,
    ]


def generate(folder: Path, *args: str, prompts: list[str] = PROMPTS, new_tokens: int = NEW_TOKENS) -> str:
    """stdout of one process of `python -m titanlite.generate`, which must succeed."""
    argv = argv_for(folder, *args, prompts=prompts, new_tokens=new_tokens)
    run = run_command([sys.executable, "-m", "titanlite.generate", *argv], _env(), timeout=TIMEOUT)
    assert run.returncode == 0, run.describe()
    return run.stdout


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory, tok) -> dict[str, tuple[list[str], str]]:
    """Hugging Face folders transformers wrote, with generate's argv for each and what it
    must print: for Llama the first token (transformers' argmax), for Qwen3 and Qwen3-MoE
    (the debug flavor with an expert bias: zero from HF, as HF routes) and DeepSeek-V3 (its
    debug flavor: MLA, YaRN, group-limited routing, the expert bias drawn in HF's file) the
    greedy text of every prompt, recomputed by transformers. Empty without transformers (the other runs go on)."""
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError:
        return {}
    from tests.helpers import hf_deepseek_v3, hf_gpt_oss
    from tests.helpers.hf_qwen3 import transformers_model
    from titanlite.models import get_model_spec
    from titanlite.models.llama import llama3_hf as hf_adapter

    folder = tmp_path_factory.mktemp("hf")
    flavor = hf_adapter.hf_config(get_model_spec("llama3", "debugmodel").args_for("debugmodel", tok.vocab_size))
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_parameters",
        "tie_word_embeddings",
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: flavor[k] for k in keys}, attn_implementation="eager")
    llama = transformers.LlamaForCausalLM(config).eval()
    llama.save_pretrained(folder / "llama")
    ids = tok.encode(PROMPT, bos=True, eos=False)
    with one_thread():
        argmax = int(llama(torch.tensor([ids])).logits[0, -1].argmax())
    out = {
        "hf_llama": (
            argv_for(folder / "llama", prompts=[PROMPT], new_tokens=1),
            tok.decode(ids + ([argmax] if argmax != tok.eos_id else [])) + "\n",
        )
    }
    spec = get_model_spec("qwen3")
    for flavor in ("debugmodel", "debugmodel_moe"):
        model = transformers_model(spec.args_for(flavor, tok.vocab_size), seed=2)
        model.save_pretrained(folder / flavor)
        out[f"hf_qwen3_{flavor}"] = (
            argv_for(folder / flavor, "--model.name", "qwen3", "--model.flavor", flavor),
            greedy(lambda x, model=model: model(x).logits, tok),
        )
    deepseek = hf_deepseek_v3.transformers_model(
        get_model_spec("deepseek_v3").args_for("debugmodel", tok.vocab_size), seed=2
    )
    deepseek.save_pretrained(folder / "deepseek_v3")
    out["hf_deepseek_v3_debugmodel"] = (
        argv_for(folder / "deepseek_v3", "--model.name", "deepseek_v3", "--model.flavor", "debugmodel"),
        greedy(lambda x: deepseek(x).logits, tok),
    )
    # gpt-oss with sinks, biases and windows of 8 tokens on alternate blocks (the prompts and their
    # new tokens pass them: the KV cache's window mask decides)
    args = get_model_spec("gpt_oss").args_for("debugmodel_window8", tok.vocab_size)
    gpt_oss = hf_gpt_oss.transformers_model(args, seed=2)
    gpt_oss.save_pretrained(folder / "gpt_oss")
    out["hf_gpt_oss_window8"] = (
        argv_for(folder / "gpt_oss", "--model.name", "gpt_oss", "--model.flavor", "debugmodel_window8"),
        greedy(lambda x: gpt_oss(x).logits, tok),
    )
    return out


@pytest.fixture(scope="module")
def one_process(checkpoint, gpt2, hf_folders, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every one-process run of these tests, in one interpreter (the imports paid once)."""
    prompt_file = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS[:2]) + "\n\n" + PROMPTS[2] + "\n")  # a blank line is skipped
    runs = {
        "batch": argv_for(checkpoint),
        "file": [
            *CONFIG,
            "--checkpoint",
            str(checkpoint),
            "--prompt-file",
            str(prompt_file),
            "--max-new-tokens",
            str(NEW_TOKENS),
        ],
        "recompute": argv_for(checkpoint, "--no-kv-cache"),
        "sample": argv_for(checkpoint, *SAMPLE, "--seed", "3"),
        "sample_alone": argv_for(checkpoint, *SAMPLE, "--seed", "3", prompts=PROMPTS[2:]),
        "other_seed": argv_for(checkpoint, *SAMPLE, "--seed", "4"),
        "tied": argv_for(checkpoint, "--model.flavor", "debugmodel_tied", prompts=PROMPTS[:1]),
        "gpt2": argv_for(gpt2[0], "--model.name", "gpt2"),
        **{name: argv for name, (argv, _) in hf_folders.items()},
    }
    results = run_mains("titanlite.generate.cli", list(runs.values()), 4 * TIMEOUT, env=_env())
    return dict(zip(runs, results))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """This process's forwards on one thread: with the other core busy (the generate
    process, the other test worker) a second OpenMP thread only waits, 10-40x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def trained_model(step_dir: Path, vocab_size: int) -> torch.nn.Module:
    """The debug model with the checkpoint's weights, read here with DCP directly."""
    import torch.distributed.checkpoint as dcp

    from titanlite.models import get_model_spec

    spec = get_model_spec("llama3", "debugmodel")
    model = spec.model_class(spec.args_for("debugmodel", vocab_size))
    model.init_weights(seed=0)  # fills the RoPE table; every weight is then loaded
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


def greedy(model: torch.nn.Module, tok: Tokenizer) -> str:
    """What generate must print for PROMPTS at temperature 0: each prompt alone, the whole
    sequence recomputed for every token, argmax, stopping at the end-of-text token."""
    texts = []
    with one_thread():
        for prompt in PROMPTS:
            ids = tok.encode(prompt, bos=True, eos=False)
            for _ in range(NEW_TOKENS):
                chosen = int(model(torch.tensor([ids]))[0, -1].argmax())
                if chosen == tok.eos_id:
                    break
                ids.append(chosen)
            texts.append(tok.decode(ids) + "\n")
    return "".join(texts)


@pytest.fixture(scope="module")
def greedy_text(checkpoint, tok) -> str:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # dcp.load here, on one process
        return greedy(trained_model(checkpoint / "step-4", tok.vocab_size), tok)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory, tok) -> tuple[Path, str]:
    """A DCP folder of the GPT-2 debug model (a model without a KV cache) at a seeded init,
    written here (another writer's checkpoint: no commit record), and its greedy text."""
    import torch.distributed.checkpoint as dcp

    from titanlite.models import get_model_spec

    spec = get_model_spec("gpt2", "debugmodel")
    model = spec.model_class(spec.args_for("debugmodel", tok.vocab_size))
    model.init_weights(seed=1)
    folder = tmp_path_factory.mktemp("gpt2")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
    return folder, greedy(model.eval(), tok)


def test_greedy_batch_follows_the_models_argmax_with_and_without_the_cache(one_process, greedy_text):
    for name in ("batch", "file", "recompute"):
        run = one_process[name]
        assert run.returncode == 0, f"{name}:\n{run.stderr[-3000:]}"
        assert run.stdout == greedy_text, f"{name} printed {run.stdout!r}"
    batch, recompute = one_process["batch"].stderr, one_process["recompute"].stderr
    assert "generate: compute dtype float32 (set by training.mixed_precision_param)" in batch
    assert f"generate: {len(PROMPTS) * NEW_TOKENS} new tokens for {len(PROMPTS)} prompt(s) in " in batch
    assert " tokens/s (" in batch and "KV cache)" in batch
    assert "no KV cache: every forward recomputes the whole rows" in recompute


def test_a_model_without_a_kv_cache_recomputes_every_sequence(one_process, gpt2):
    run = one_process["gpt2"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == gpt2[1]
    assert "generate: model gpt2 has no KV cache; each token recomputes the whole sequence" in run.stderr


def test_sampling_is_seeded_per_prompt(one_process):
    sample, alone, other = (one_process[name] for name in ("sample", "sample_alone", "other_seed"))
    assert sample.returncode == alone.returncode == other.returncode == 0, sample.stderr[-3000:]
    assert all(text.startswith(prompt) for text, prompt in zip(sample.stdout.splitlines(), PROMPTS))
    assert sample.stdout.endswith(alone.stdout)  # the last prompt's text, with or without the others
    # Eight draws among the top 5 for each prompt: two seeds agreeing on all is vanishingly unlikely.
    assert other.stdout != sample.stdout


def test_a_checkpoint_of_another_flavor_is_refused_as_a_resume_refuses_it(one_process):
    run = one_process["tied"]
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stdout == "" and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("titanlite: error:")]
    assert (
        len(errors) == 1
        and "flavor debugmodel (" in errors[0]
        and "builds model llama3 flavor debugmodel_tied" in errors[0]
    )


@pytest.mark.parametrize(
    "layout, args",
    [
        ("tensor_parallel", ["--parallelism.tensor_parallel_degree", "2"]),
        ("fsdp", ["--parallelism.data_parallel_shard_degree", "2"]),
        ("pipeline", [*PIPELINE, *SAMPLE, "--seed", "3"]),
    ],
)
def test_every_layout_prints_what_one_process_prints(checkpoint, one_process, greedy_text, layout, args):
    run = run_ranks(2, ["-m", "titanlite.generate"], argv_for(checkpoint, *args), TIMEOUT, env=_env())
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    expected = one_process["sample"].stdout if "--seed" in args else greedy_text
    assert run.stdout == expected  # both ranks' stdout: rank 1 printed nothing
    assert run.stderr.count("tokens/s") == 1


@pytest.mark.parametrize(
    "args, mentions",
    [
        (["--checkpoint", "/no/such/folder", "--prompt", PROMPT], ["--checkpoint", "/no/such/folder"]),
        (["--prompt", PROMPT, "--prompt", ""], ["--prompt", "empty"]),
        (["--prompt-file", "/no/such/prompts.txt"], ["--prompt-file", "/no/such/prompts.txt"]),
        (["--prompt", PROMPT, "--prompt-file", "/no/such/prompts.txt"], ["--prompt-file", "--prompt"]),
        (["--prompt", PROMPT, "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
        (["--prompt", PROMPT, "--top-k", "-1"], ["--top-k", ">= 0"]),
        (
            ["--prompt", PROMPT, "--parallelism.context_parallel_degree", "2"],
            ["parallelism.context_parallel_degree", "use 1"],
        ),
    ],
    ids=[
        "missing_checkpoint",
        "empty_prompt",
        "missing_prompt_file",
        "prompt_and_file",
        "no_new_tokens",
        "negative_top_k",
        "context_parallel",
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, mentions):
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(tmp_path), *args]
    run = run_command([sys.executable, "-m", "titanlite.generate", *CONFIG, *args], _env(), timeout=TIMEOUT)
    assert_one_line_user_error(run, mentions)
    assert run.stdout == ""


@pytest.mark.parametrize(
    "name",
    ["hf_llama", "hf_qwen3_debugmodel", "hf_qwen3_debugmodel_moe", "hf_deepseek_v3_debugmodel", "hf_gpt_oss_window8"],
)
def test_hugging_face_folder_gives_transformers_tokens(one_process, hf_folders, name):
    if not hf_folders:
        pytest.skip("transformers and safetensors are not both installed")
    run = one_process[name]
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == hf_folders[name][1]
