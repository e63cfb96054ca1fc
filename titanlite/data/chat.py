"""Chat data for supervised fine-tuning: conversations become windows of whole conversations,
each token with a loss mask beside it, through the same preparation and shards as pretraining
text (prepare.py; the mask is each shard's `.mask` file, shard_format.py).

A conversation is one JSONL line (or `datasets` row): `{"messages": [{"role", "content"}, ...]}`
with roles system, user, assistant and tool, or `{"prompt": ..., "completion": ...}`, each a
string (one user, one assistant message) or a list of messages. It is rendered with the chat
template (chat_template.py) and tokenized whole, as TRL's `SFTTrainer` does, and trained where
TRL trains it: in `messages`, the tokens that overlap the template's `{% generation %}` blocks
(`assistant_only_loss`); in a prompt/completion pair, the tokens after the longest common prefix
of the tokenized prompt (rendered with the generation prompt) and of the whole pair
(`completion_only_loss`).

Conversations are packed in order into windows of `training.seq_len + 1` tokens: one that does
not fit in what is left of a window starts the next, and the rest of the window is padding
(the eos id, never trained) at the end of the last conversation's document; one longer than a
window is truncated to its start or dropped (`sft.overlong`), and the counts go to the manifest
and the log. Each conversation is a document, so block-causal attention keeps every
conversation to itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from titanlite.data.chat_template import FIELD, ChatTemplate, find_template
from titanlite.data.hf_source import HFSource
from titanlite.data.sources import FilesSource, jsonl_records
from titanlite.data.tokenizers import Tokenizer
from titanlite.errors import TitanliteError

ROLES = ("system", "user", "assistant", "tool")
OVERLONG = ("truncate", "drop")
Encoded = tuple[list[int], list[int]]  # token ids, and 1 where the token is trained


def _messages(value: Any, where: str, key: str, role: str) -> list[dict[str, Any]]:
    """`value` as a checked list of messages (a string: one message of `role`); keys holding
    null are dropped, as transformers does before rendering."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise TitanliteError(f'training.dataset_path: {where}: "{key}" is not a non-empty list of messages')
    for message in value:
        if message.get("role") not in ROLES:
            raise TitanliteError(
                f"training.dataset_path: {where}: unknown role {message.get('role')!r} in {key!r} (expected one of "
                f"{', '.join(ROLES)})"
            )
    return [{k: v for k, v in message.items() if v is not None} for message in value]


def conversation(record: Any, where: str) -> str:
    """A checked conversation as the JSON text that preparation's workers render."""
    if isinstance(record, dict) and "messages" in record:
        return json.dumps({"messages": _messages(record["messages"], where, "messages", "user")})
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        pair = {k: _messages(record[k], where, k, r) for k, r in (("prompt", "user"), ("completion", "assistant"))}
        return json.dumps(pair)
    raise TitanliteError(f'training.dataset_path: {where}: a conversation has "messages", or "prompt" and "completion"')


class ChatFiles(FilesSource):
    """Local .jsonl files of conversations, one a line (a file, or a folder's in sorted order)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.name = f"chat:{path}"
        if other := [f for f in self.files if f.suffix != ".jsonl"]:
            raise TitanliteError(f"training.dataset_path: chat data is .jsonl files; {other[0]} is not one")

    def _documents(self) -> Iterator[str]:
        for path in self.files:
            for record, where in jsonl_records(path):
                yield conversation(record, where)


class ChatHF(HFSource):
    """A Hugging Face dataset of conversations, for the prepare command (`hf:NAME --chat N`)."""

    def _documents(self) -> Iterator[str]:
        for row, example in enumerate(self.dataset):
            yield conversation(example, f"{self.name} row {row}")


@dataclass(frozen=True)
class ChatPacking:
    """How conversations become windows: the template (its text, where it came from, and the
    `sft.chat_template` that named it: empty for the tokenizer's own), the window
    (`training.seq_len + 1` tokens) and what becomes of a longer conversation."""

    template: str
    origin: str
    configured: str
    window: int
    overlong: str

    def job(self) -> dict[str, Any]:
        """What a prepared folder records of it (a changed one is another preparation)."""
        template = ChatTemplate(self.template, self.origin, {})
        return {"window": self.window, "overlong": self.overlong, "template_sha256": template.sha256}


def chat_packing(configured_template: str, tokenizer: Tokenizer, window: int, overlong: str) -> ChatPacking:
    """The checked packing of a run or a prepare command: a tokenizer.json and a template that compiles."""
    if tokenizer.kind != "tokenizer.json":
        raise TitanliteError(
            f"model.tokenizer_path: chat data needs a Hugging Face tokenizer.json (chat templates write its special "
            f"tokens); {tokenizer.path} is a {tokenizer.kind} file"
        )
    text, origin = find_template(configured_template, tokenizer.path)
    ChatTemplate(text, origin, {})
    return ChatPacking(text, origin, configured_template, window, overlong)


def chat_counts(chat: dict[str, Any]) -> str:
    """The line a preparation and a run log of a prepared chat folder (its manifest's "chat")."""
    return (
        f"chat data: {chat['conversations']:,} conversations in windows of {chat['window']} tokens; longer ones: "
        f"{chat['truncated']:,} truncated, {chat['dropped']:,} dropped (sft.overlong {chat['overlong']})"
    )


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """bos_token and eos_token as text (those the tokenizer has), which templates read."""
    names = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
    return {name: tokenizer.backend.tok.id_to_token(i) for name, i in names.items() if i >= 0}


def encode(text: str, template: ChatTemplate, tokenizer: Tokenizer) -> Encoded:
    """One conversation (`conversation`'s JSON) as token ids and its loss mask (see the module doc)."""
    record, chat = json.loads(text), tokenizer.backend.encode_chat
    if "messages" in record:
        if not template.marks_generation:
            raise TitanliteError(
                f"{FIELD}: {template.origin} has no {{% generation %}} block, so no token of a conversation given as "
                '"messages" would be trained (prompt/completion pairs need none)'
            )
        rendered, spans = template.render(record["messages"])
        ids, offsets = chat(rendered)
        return ids, [int(any(s < span.stop and e > span.start for span in spans)) for s, e in offsets]
    prompt_ids = chat(template.render(record["prompt"], add_generation_prompt=True)[0])[0]
    ids = chat(template.render(record["prompt"] + record["completion"])[0])[0]
    prefix = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(prompt_ids), len(ids)))
    return ids, [0] * prefix + [1] * (len(ids) - prefix)


def pack(conversations: Iterable[Encoded], window: int, overlong: str, pad: int) -> tuple[list, list, dict]:
    """Documents, their masks and the counts (conversations kept, truncated, dropped) of
    conversations packed in order into windows of `window` tokens (see the module doc)."""
    documents: list[list[int]] = []
    masks: list[list[int]] = []
    counts = dict.fromkeys(("conversations", "truncated", "dropped"), 0)
    used = 0
    for ids, mask in conversations:
        if len(ids) > window:
            counts["dropped" if overlong == "drop" else "truncated"] += 1
            if overlong == "drop":
                continue
            ids, mask = ids[:window], mask[:window]
        if used + len(ids) > window:
            used = _pad(documents, masks, window - used, pad)
        documents.append(ids)
        masks.append(mask)
        used += len(ids)
        counts["conversations"] += 1
    if used:
        _pad(documents, masks, window - used, pad)
    return documents, masks, counts


def _pad(documents: list[list[int]], masks: list[list[int]], n: int, pad: int) -> int:
    """`n` untrained pad tokens at the end of the last document (its window is full); 0 tokens used."""
    documents[-1], masks[-1] = documents[-1] + [pad] * n, masks[-1] + [0] * n
    return 0


def pack_shard(texts: list[str], tokenizer: Tokenizer, packing: ChatPacking) -> tuple[list, list, dict]:
    """A preparation unit's conversations as one shard's documents, masks and counts."""
    template = ChatTemplate(packing.template, packing.origin, special_tokens(tokenizer))
    encoded = (encode(text, template, tokenizer) for text in texts)
    return pack((e for e in encoded if e[0]), packing.window, packing.overlong, max(tokenizer.eos_id, 0))
