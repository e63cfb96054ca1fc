"""Chat data for supervised fine-tuning (titanlite/data/chat.py, chat_template.py): the tokens and
loss masks a preparation writes are TRL's `SFTTrainer` labels on the same conversations and
template, token for token; conversations are packed whole into windows (longer ones truncated or
dropped, counted); the loader masks the labels; no conversation attends to another packed in its
window; and a bad conversation or template is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.distributed import REPO
from tests.helpers.chat_data import TEMPLATE, chat_files, conversations, write_jsonl
from titanlite.data.chat import ChatFiles, chat_packing, conversation, encode, special_tokens
from titanlite.data.chat_template import ChatTemplate
from titanlite.data.loader import IGNORE, TokenWindowLoader
from titanlite.data.prepare import main as prepare_main
from titanlite.data.prepare import prepare
from titanlite.data.token_shards import TokenShards
from titanlite.data.tokenizers import Tokenizer
from titanlite.data.windows import DatasetWindows, WindowStream
from titanlite.errors import TitanliteError

pytestmark = pytest.mark.usefixtures("logger_left_as_found")  # the prepare command sets the logger up


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return chat_files(tmp_path_factory.mktemp("chat"))


def prepared(files: dict[str, Path], records: list[dict], folder: Path, window: int, overlong: str = "truncate"):
    """`records` prepared (one worker, several shards) into `folder`; returns the opened shards."""
    tokenizer = Tokenizer(str(files["tokenizer.json"]))
    source = ChatFiles(str(write_jsonl(folder.with_suffix(".jsonl"), records)))
    prepare(source, tokenizer, folder, shard_chars=3000, chat=chat_packing("", tokenizer, window, overlong))
    return TokenShards(folder, verify=True)


def documents(shards: TokenShards) -> list[tuple[list[int], list[int]]]:
    """Every document's tokens and mask, in order."""
    out = []
    for k, start in enumerate(shards.starts[:-1]):
        offsets = shards.document_offsets(k).astype(np.int64)
        for a, b in zip(offsets[:-1], offsets[1:]):
            out.append(
                (shards.read(start + a, b - a).tolist(), shards.read_mask(start + a, b - a).astype(int).tolist())
            )
    return out


def trl_labels(files: dict[str, Path], rows: list[dict], tmp_path: Path) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of TRL's SFTTrainer on `rows` (messages with assistant_only_loss, or
    prompt/completion with its default completion-only loss), built with a tiny Llama."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(files["tokenizer.json"]), bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    tokenizer.chat_template = TEMPLATE
    shape = dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, **shape))
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        assistant_only_loss="messages" in rows[0],
        max_length=None,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = trl.SFTTrainer(model, config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    return [(row["input_ids"], row["labels"]) for row in trainer.train_dataset]


def assert_same_as_trl(ours: list[tuple[list[int], list[int]]], theirs: list, pad: int) -> None:
    assert len(ours) == len(theirs)
    for (ids, mask), (their_ids, their_labels) in zip(ours, theirs):
        n = len(their_ids)
        assert ids[:n] == their_ids and set(ids[n:]) <= {pad}  # the end of a window: padding
        assert mask[:n] == [int(label != -100) for label in their_labels] and not any(mask[n:])


def test_messages_are_masked_as_trls_assistant_only_loss(files, tmp_path):
    rows = conversations(40, seed=3)
    shards = prepared(files, rows, tmp_path / "messages", window=512)
    ours = documents(shards)
    assert_same_as_trl(ours, trl_labels(files, rows, tmp_path), pad=shards.manifest["tokenizer"]["eos_id"])
    assert all(any(mask) and not all(mask) for _, mask in ours)


def test_prompt_completion_pairs_are_masked_as_trls_completion_only_loss(files, tmp_path):
    rows = [{"prompt": c["messages"][:-1], "completion": c["messages"][-1:]} for c in conversations(40, seed=4)]
    shards = prepared(files, rows, tmp_path / "pairs", window=512)
    assert_same_as_trl(documents(shards), trl_labels(files, rows, tmp_path), pad=shards.manifest["tokenizer"]["eos_id"])
    # Plain strings are one user and one assistant message.
    strings = [{"prompt": "What is one plus two?", "completion": "one plus two is three."}]
    as_messages = [
        {
            "prompt": [{"role": "user", "content": strings[0]["prompt"]}],
            "completion": [{"role": "assistant", "content": strings[0]["completion"]}],
        }
    ]
    plain = documents(prepared(files, strings, tmp_path / "strings", window=512))
    assert plain == documents(prepared(files, as_messages, tmp_path / "as_messages", window=512))


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_whole_conversations_are_packed_per_window_and_longer_ones_counted(files, tmp_path, overlong):
    rows = conversations(120)
    shards = prepared(files, rows, tmp_path / overlong, window=65, overlong=overlong)
    chat = shards.manifest["chat"]
    tokenizer = Tokenizer(str(files["tokenizer.json"]))
    template = ChatTemplate(TEMPLATE, "test", special_tokens(tokenizer))
    long = sum(len(encode(conversation(row, "test"), template, tokenizer)[0]) > 65 for row in rows)
    assert long and chat["truncated" if overlong == "truncate" else "dropped"] == long
    assert chat["conversations"] == len(rows) - (long if overlong == "drop" else 0)
    assert shards.num_tokens % 65 == 0 and all(e.tokens % 65 == 0 for e in shards.entries)
    bos = shards.manifest["tokenizer"]["bos_id"]
    for w in range(shards.num_tokens // 65):
        tokens, ids = shards.read(65 * w, 65), shards.document_ids(65 * w, 65)
        assert tokens[0] == bos and (tokens[ids != np.roll(ids, 1)] == bos).all()  # each starts a conversation


def test_the_loader_masks_the_labels_not_trained(files, tmp_path):
    shards = prepared(files, conversations(60), tmp_path / "loader", window=65)
    stream = WindowStream([DatasetWindows(shards, 65, 0, shards.num_tokens // 65, None)], [1.0], "chat")
    inputs, labels, document_ids = TokenWindowLoader(stream, 4, 0, 1, prefetch=False, documents=True).batch_at(0)
    windows = shards.read(0, 4 * 65).reshape(4, 65)
    trained = shards.read_mask(0, 4 * 65).reshape(4, 65)
    assert torch.equal(inputs, torch.from_numpy(windows[:, :-1]))
    assert torch.equal(labels, torch.from_numpy(np.where(trained[:, 1:], windows[:, 1:], IGNORE)))
    assert stream.masked and (labels == IGNORE).any() and (labels != IGNORE).any()


def test_a_changed_mask_byte_is_caught_by_its_checksum(files, tmp_path):
    prepared(files, conversations(30), tmp_path / "crc", window=65)
    mask = tmp_path / "crc" / "shard-00000.mask"
    mask.write_bytes(bytes([1 - mask.read_bytes()[0]]) + mask.read_bytes()[1:])
    with pytest.raises(TitanliteError, match=r"shard-00000.mask is corrupted: CRC-32"):
        TokenShards(tmp_path / "crc", verify=True).read_mask(0, 65)


def test_no_token_attends_to_another_conversation_in_its_window(files, tmp_path):
    """A poisoned neighbor: the first conversation of a window replaced by random tokens leaves
    the second's logits and loss as they were with the document mask, and changes them without it
    (one document id for the whole window: plain causal attention)."""
    from titanlite.build import plan_run
    from titanlite.config import load_config
    from titanlite.step.loss import cross_entropy

    shards = prepared(files, conversations(60), tmp_path / "poison", window=65)
    argv = ["--config", "debug_model", "--model.tokenizer_path", str(files["tokenizer.json"])]
    plan = plan_run(load_config(argv + ["--training.seq_len", "64", "--model.attn_mask_type", "block_causal"]), 1)
    with torch.device("meta"):
        model = plan.spec.model_class(plan.model_args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    w = next(w for w in range(shards.num_tokens // 65) if shards.document_ids(65 * w, 65).max() > 0)
    tokens, ids = torch.from_numpy(shards.read(65 * w, 65)), torch.from_numpy(shards.document_ids(65 * w, 65))
    trained = torch.from_numpy(shards.read_mask(65 * w, 65))
    poisoned = torch.where(ids == 0, torch.randint(0, 320, (65,), generator=torch.Generator().manual_seed(1)), tokens)
    second = ids[:-1] == 1
    labels = torch.where(trained[1:] & second, tokens[1:], IGNORE)[None]

    def run(window: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = model(window[None, :-1], document_ids=(ids if masked else torch.zeros_like(ids))[None, :-1])
        return logits[0, second], cross_entropy(logits, labels, (labels >= 0).sum().float())

    assert labels.ne(IGNORE).any()
    (logits, loss), (poisoned_logits, poisoned_loss) = run(tokens, True), run(poisoned, True)
    torch.testing.assert_close(poisoned_logits, logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(poisoned_loss, loss, rtol=0, atol=1e-6)
    assert not torch.allclose(run(tokens, False)[0], run(poisoned, False)[0], atol=1e-3)


def test_an_unknown_role_is_one_line_naming_the_file_and_line(files, tmp_path):
    rows = conversations(3)
    rows[1]["messages"][0]["role"] = "robot"
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TitanliteError, match=rf"training.dataset_path: {path}:2: unknown role 'robot' in 'messages'"):
        list(ChatFiles(str(path)).one_pass())


def test_a_template_that_fails_to_render_is_one_line_and_exit_2(files, tmp_path, capsys):
    """From the prepare command (a worker's error, carried to the parent): one line, exit 2."""
    template = tmp_path / "fails.jinja"
    template.write_text(
        "{% for m in messages %}{{ raise_exception('no ' + m['role'] + ' turns here') }}{% endfor %}"
        "{% generation %}{% endgeneration %}"
    )
    data = write_jsonl(tmp_path / "data.jsonl", conversations(3))
    argv = [str(data), str(tmp_path / "out"), "--tokenizer", str(files["tokenizer.json"]), "--workers", "1"]
    assert prepare_main([*argv, "--chat", "64", "--chat-template", str(template)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"titanlite: error: --chat-template: {template} failed to render a conversation "
        "(TemplateError: no system turns here)"
    ]
    template.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(TitanliteError, match=rf"sft.chat_template: {template} is not a Jinja template \("):
        chat_packing(str(template), Tokenizer(str(files["tokenizer.json"])), 65, "truncate")


def test_messages_need_a_template_with_generation_blocks(files, tmp_path):
    config = json.loads((files["tokenizer.json"].parent / "tokenizer_config.json").read_text())
    template = tmp_path / "plain.jinja"
    template.write_text(config["chat_template"].replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    tokenizer = Tokenizer(str(files["tokenizer.json"]))
    source = ChatFiles(str(write_jsonl(tmp_path / "m.jsonl", conversations(2))))
    with pytest.raises(TitanliteError, match=r"has no \{% generation %\} block"):
        prepare(source, tokenizer, tmp_path / "out", chat=chat_packing(str(template), tokenizer, 65, "truncate"))


def test_a_hugging_face_dataset_of_conversations_prepares_as_the_local_file(files, tmp_path):
    """`python -m titanlite.data.prepare hf:... --chat N`: rows of `datasets` are conversations too."""
    pytest.importorskip("datasets")
    from titanlite.data.prepare import open_source

    tokenizer = Tokenizer(str(files["tokenizer.json"]))
    packing = chat_packing("", tokenizer, 65, "truncate")
    path = str(write_jsonl(tmp_path / "rows.jsonl", conversations(20)))
    for name, spec in (("local", path), ("hf", f"hf:{path}")):
        prepare(open_source(spec, chat=True), tokenizer, tmp_path / name, chat=packing)
    assert documents(TokenShards(tmp_path / "hf")) == documents(TokenShards(tmp_path / "local"))


def test_the_shipped_chatml_template_renders_and_marks_the_answers_as_transformers_does():
    """assets/chat_templates/chatml.jinja (the SFT preset's, for Qwen's tokenizer): the text and the
    {% generation %} spans of a conversation are what transformers' own renderer gives."""
    from transformers.utils.chat_template_utils import render_jinja_template

    text = (REPO / "assets" / "chat_templates" / "chatml.jinja").read_text()
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]
    ours, spans = ChatTemplate(text, "chatml", {"bos_token": "", "eos_token": ""}).render(conversation)
    rendered, generation = render_jinja_template(
        conversations=[conversation], chat_template=text, return_assistant_tokens_mask=True
    )
    assert ours == rendered[0]
    assert [(span.start, span.stop) for span in spans] == [tuple(pair) for pair in generation[0]]
    assert [ours[span.start : span.stop] for span in spans] == ["Hello.<|im_end|>", "Goodbye.<|im_end|>"]
