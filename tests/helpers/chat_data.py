"""Chat data for the SFT tests (not tests themselves), made here, nothing downloaded: a tiny
byte-level BPE tokenizer.json with ChatML special tokens and a chat template with
`{% generation %}` blocks in its tokenizer_config.json, and a JSONL file of conversations (messages,
some with a system or tool turn, some of two rounds) about sums a small model learns quickly."""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _sum_turn(rng: random.Random) -> list[dict[str, str]]:
    a, b = rng.randrange(5), rng.randrange(5)
    return [
        {"role": "user", "content": f"What is {WORDS[a]} plus {WORDS[b]}?"},
        {"role": "assistant", "content": f"{WORDS[a]} plus {WORDS[b]} is {WORDS[a + b]}."},
    ]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """`n` conversations of `messages`: one or two sums, a system turn in a third of them, a
    tool turn in a tenth, three rounds (longer than a 65-token window) in a twentieth."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        messages = [{"role": "system", "content": "You add numbers."}] if k % 3 == 0 else []
        rounds = 3 if k % 20 == 7 else rng.choice((1, 1, 1, 2))
        for _ in range(rounds):
            messages += _sum_turn(rng)
        if k % 10 == 5:
            messages.insert(-1, {"role": "tool", "content": "calculator ready"})
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_chat_tokenizer(folder: Path) -> Path:
    """folder/tokenizer.json (trained on the conversations' text) and its tokenizer_config.json
    (bos, eos and the chat template); returns the tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = [m["content"] for c in conversations(200, seed=99) for m in c["messages"]]
    tok.train_from_iterator(texts + ["assistant\nuser\nsystem\ntool\n"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": SPECIAL[0], "eos_token": SPECIAL[1], "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def chat_files(root: Path) -> dict[str, Path]:
    """root/chat: the tokenizer and 300 conversations (written once; the same files every time)."""
    folder = root / "chat"
    if not (folder / "conversations.jsonl").exists():
        write_chat_tokenizer(folder)
        write_jsonl(folder / "conversations.jsonl", conversations(300))
    return {"tokenizer.json": folder / "tokenizer.json", "conversations.jsonl": folder / "conversations.jsonl"}
