"""A tokenizer's chat template: the Jinja text that turns a conversation into the string a model
is trained on, rendered the way Hugging Face `transformers` renders it (`apply_chat_template`),
so the tokens and the assistant masks are TRL's.

The template comes from `sft.chat_template` (a file) or else from beside the tokenizer file:
`chat_template.jinja` (what transformers 5 saves), else `tokenizer_config.json`'s
`chat_template` (a string, or a list of named ones: "default"). It runs in Jinja's immutable
sandbox (hub templates are untrusted code) with transformers' settings: `trim_blocks`,
`lstrip_blocks`, loop controls, `raise_exception`, an unescaped `tojson`, `strftime_now`, and the
`{% generation %}` block, whose output spans (character ranges) are the assistant's text:
there the loss is taken. The spans are found by wrapping each block's output in two
private-use characters that the rendered text then drops.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from titanlite.errors import TitanliteError, one_line

FIELD = "sft.chat_template"
_START, _END = "\ue000", "\ue001"  # around each {% generation %} block's output while rendering
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def find_template(configured: str, tokenizer_path: str) -> tuple[str, str]:
    """(template text, where it came from): the `sft.chat_template` file, or the tokenizer's own."""
    if configured:
        try:
            return Path(configured).read_text(), configured
        except OSError as e:
            raise TitanliteError(f"{FIELD}: cannot read {configured}: {e.strerror or e}") from None
    folder = Path(tokenizer_path).parent
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), str(folder / "chat_template.jinja")
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise TitanliteError(
            f"{FIELD}: empty, and {tokenizer_path} has no chat template beside it (chat_template.jinja or "
            "tokenizer_config.json's chat_template); name a Jinja file"
        )
    return template, str(folder / "tokenizer_config.json")


@functools.lru_cache(maxsize=4)
def _compile(text: str, origin: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return _START + caller() + _END

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(text)
    except jinja2.TemplateError as e:
        raise TitanliteError(f"{FIELD}: {origin} is not a Jinja template ({one_line(e)})") from None


class ChatTemplate:
    """A compiled chat template; `render` gives the text and the assistant spans of a conversation."""

    def __init__(self, text: str, origin: str, special_tokens: dict[str, str]) -> None:
        """`special_tokens`: bos_token and eos_token as text, which templates read."""
        self.text, self.origin, self.special_tokens = text, origin, special_tokens
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.marks_generation = bool(_GENERATION.search(text))
        _compile(text, origin)  # a syntax error is one line now, not in a worker

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> tuple[str, list[range]]:
        """The conversation as text, and the character ranges of its {% generation %} blocks."""
        try:
            marked = _compile(self.text, self.origin).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except Exception as e:  # the template's own raise_exception, or any error inside it
            raise TitanliteError(f"{FIELD}: {self.origin} failed to render a conversation ({one_line(e)})") from None
        text, spans, at = [], [], 0
        for k, piece in enumerate(re.split(f"[{_START}{_END}]", marked)):
            if k % 2:
                spans.append(range(at, at + len(piece)))
            text.append(piece)
            at += len(piece)
        return "".join(text), spans
