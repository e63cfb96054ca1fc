"""Supervised fine-tuning on a chat file through the real trainer (`training.dataset chat`, one
process): the conversations are prepared on first use, the loss on the assistant's tokens falls (with
LoRA on every projection of the frozen model too: 6.35 -> 1.64 in 20 steps);
and each bad chat input is one line with exit code 2. The 2-rank runs are equivalence layouts
(tests/runs/equivalence.py: sft_*)."""

from __future__ import annotations

import pytest

from tests.helpers.chat_data import chat_files, conversations, write_jsonl
from tests.helpers.distributed import read_tensorboard, run_mains, with_overrides

STEPS = 20
LORA_EVERYWHERE = ["--model.converters", "lora", "--lora.rank", "8", "--lora.alpha", "32", "--lora.target_modules"]
LORA_EVERYWHERE += ["wq,wk,wv,wo,w1,w2,w3"]


def chat_args(files: dict, dump, *extra: str) -> list[str]:
    base = [
        "--config",
        "debug_model",
        "--model.tokenizer_path",
        str(files["tokenizer.json"]),
        "--model.attn_mask_type",
        "block_causal",
        "--training.dataset",
        "chat",
        "--training.dataset_path",
        str(files["conversations.jsonl"]),
        "--training.dataset_cache_dir",
        str(dump.parent / "cache"),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--training.mixed_precision_param",
        "float32",
        "--training.steps",
        str(STEPS),
        "--optimizer.lr",
        "3e-3",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.peak_flops",
        "1e11",
        "--job.dump_folder",
        str(dump),
    ]
    return with_overrides(base, list(extra))


@pytest.mark.timeout(600)
def test_a_chat_file_trains_and_bad_chat_input_is_one_line(tmp_path):
    files = chat_files(tmp_path)
    bad_role = conversations(5)
    bad_role[3]["messages"][1]["role"] = "narrator"
    bad_file = write_jsonl(tmp_path / "bad.jsonl", bad_role)
    failing = tmp_path / "fails.jinja"
    failing.write_text("{% generation %}{% endgeneration %}{{ raise_exception('this template renders nothing') }}")
    runs = {
        "trains": chat_args(files, tmp_path / "trains"),
        # The fine-tuning preset's combination: LoRA on every projection of the frozen model.
        "lora": chat_args(files, tmp_path / "lora", *LORA_EVERYWHERE),
        "unknown_role": chat_args(files, tmp_path / "role", "--training.dataset_path", str(bad_file)),
        "template_fails": chat_args(files, tmp_path / "template", "--sft.chat_template", str(failing)),
        "causal": chat_args(files, tmp_path / "causal", "--model.attn_mask_type", "causal"),
    }
    results = dict(zip(runs, run_mains("titanlite.train", list(runs.values()), 500)))
    trained = results["trains"]
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "chat data: 300 conversations in windows of 65 tokens; longer ones: " in trained.stderr + trained.stdout
    losses = [loss for _, loss in read_tensorboard(tmp_path / "trains" / "tb")["loss"]]
    assert len(losses) == STEPS and losses[-1] < 0.5 * losses[0], losses
    assert results["lora"].returncode == 0, results["lora"].stderr[-3000:]
    adapted = [loss for _, loss in read_tensorboard(tmp_path / "lora" / "tb")["loss"]]
    assert len(adapted) == STEPS and adapted[-1] < 0.5 * adapted[0], adapted
    expected = {
        "unknown_role": f"training.dataset_path: {bad_file}:4: unknown role 'narrator' in 'messages'",
        "template_fails": f"sft.chat_template: {failing} failed to render a conversation (TemplateError: this",
        "causal": "model.attn_mask_type: chat data packs several conversations in a window; set block_causal",
    }
    for name, text in expected.items():
        lines = [line for line in results[name].stderr.splitlines() if line.strip()]
        assert results[name].returncode == 2 and len(lines) == 1, (name, lines)
        assert lines[0].startswith(f"titanlite: error: {text}"), (name, lines)
