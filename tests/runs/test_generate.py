"""`python -m titanlite.generate` on a checkpoint the real trainer wrote (debug model, 4 steps,
fp32, CPU), and on a Hugging Face folder transformers wrote:

- greedy text is the same on two runs, and is the continuation this test computes itself
  from the checkpoint's weights (argmax of the model's own logits, token by token);
- seeded top-k sampling gives the same text on 1 process and at tensor parallel 2 (rank 1
  prints nothing), and another seed gives another text;
- bad input is one `titanlite: error:` line and exit code 2;
- from a Hugging Face folder, the first token is the argmax of transformers' own logits.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.commands import assert_one_line_user_error, run_command
from tests.helpers.distributed import REPO, run_env, run_mains, run_ranks
from titanlite.data.tokenizers import Tokenizer

pytestmark = pytest.mark.slow

TIMEOUT = 120
PROMPT = "The Python language"
NEW_TOKENS = 8
CONFIG = ["--config", "debug_model", "--training.mixed_precision_param", "float32"]
TRAIN = [
    *CONFIG,
    "--training.seq_len", "64",
    "--training.local_batch_size", "2",
    "--training.steps", "4",
    "--optimizer.lr", "3e-3",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.enable_tensorboard", "false",
    "--metrics.peak_flops", "1e11",  # no start-up matmul measurement
    "--checkpoint.enable_checkpoint", "true",
    "--checkpoint.interval", "2",  # step-2 and step-4: generate must take the newest
    "--checkpoint.async_mode", "disabled",
]  # fmt: skip
SAMPLE = ["--temperature", "0.8", "--top-k", "5"]


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


def generate(folder: Path, *args: str, new_tokens: int = NEW_TOKENS) -> str:
    """stdout of one process of `python -m titanlite.generate`, which must succeed."""
    argv = [*CONFIG, "--checkpoint", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(new_tokens), *args]
    run = run_command([sys.executable, "-m", "titanlite.generate", *argv], _env(), timeout=TIMEOUT)
    assert run.returncode == 0, run.describe()
    return run.stdout


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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load here, on one process
def test_greedy_is_repeatable_and_follows_the_models_argmax(checkpoint, tok):
    first, second = generate(checkpoint), generate(checkpoint)
    assert first == second
    model = trained_model(checkpoint / "step-4", tok.vocab_size)
    ids = tok.encode(PROMPT, bos=True, eos=False)
    with one_thread():
        for _ in range(NEW_TOKENS):
            chosen = int(model(torch.tensor([ids]))[0, -1].argmax())
            if chosen == tok.eos_id:  # where generate stops too
                break
            ids.append(chosen)
    assert first == tok.decode(ids) + "\n", f"generate printed {first!r}"


def test_sampling_is_seeded_and_the_same_under_tensor_parallel(checkpoint):
    single = generate(checkpoint, *SAMPLE, "--seed", "3")
    argv = [*CONFIG, "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
            *SAMPLE, "--seed", "3", "--parallelism.tensor_parallel_degree", "2"]
    tp = run_ranks(2, ["-m", "titanlite.generate"], argv, TIMEOUT, env=_env())
    assert tp.returncode == 0, f"{tp.stdout[-3000:]}\n{tp.stderr[-3000:]}"
    assert tp.stdout == single  # both ranks' stdout: rank 1 printed nothing
    assert single.startswith(PROMPT) and len(single) > len(PROMPT) + 1
    # Eight draws among the top 5: two seeds agreeing on all of them is vanishingly unlikely.
    assert generate(checkpoint, *SAMPLE, "--seed", "4") != single


@pytest.mark.parametrize("args, mentions", [
    (["--checkpoint", "/no/such/folder", "--prompt", PROMPT], ["--checkpoint", "/no/such/folder"]),
    (["--prompt", ""], ["--prompt", "empty"]),
    (["--prompt", PROMPT, "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["--prompt", PROMPT, "--top-k", "-1"], ["--top-k", ">= 0"]),
], ids=["missing_checkpoint", "empty_prompt", "no_new_tokens", "negative_top_k"])  # fmt: skip
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, mentions):
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(tmp_path), *args]
    run = run_command([sys.executable, "-m", "titanlite.generate", *CONFIG, *args], _env(), timeout=TIMEOUT)
    assert_one_line_user_error(run, mentions)
    assert run.stdout == ""


def test_hugging_face_folder_gives_transformers_argmax(tmp_path, tok):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from titanlite.models import get_model_spec
    from titanlite.models.llama import hf_adapter

    flavor = hf_adapter.hf_config(get_model_spec("llama3", "debugmodel").args_for("debugmodel", tok.vocab_size))
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "tie_word_embeddings")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: flavor[k] for k in keys}, attn_implementation="eager")
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    ids = tok.encode(PROMPT, bos=True, eos=False)
    with one_thread():
        argmax = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
    printed = generate(tmp_path / "hf", new_tokens=1)
    assert printed == tok.decode(ids + ([argmax] if argmax != tok.eos_id else [])) + "\n"
