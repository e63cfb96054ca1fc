"""The `[sft]` section: how chat data (`training.dataset = "chat"`) becomes training windows,
read by `data/chat.py` (docs/fine_tuning.md); `sections.JobConfig` holds it."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.engine import option as _opt


@dataclass
class SFT:
    """Supervised fine-tuning on conversations: the chat template and what becomes of a long one."""

    chat_template: str = _opt(
        "",
        "a Jinja chat template file; empty = the tokenizer's own (chat_template.jinja or tokenizer_config.json's "
        "chat_template beside model.tokenizer_path)",
    )
    overlong: str = _opt(
        "truncate",
        "a conversation longer than training.seq_len + 1 tokens: truncate (keep its start) or drop",
        choices=("truncate", "drop"),
    )
