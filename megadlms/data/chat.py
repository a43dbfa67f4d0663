"""Chat records -> token ids plus a per-token loss mask (assistant tokens 1, everything else 0).

Records are jsonl objects with OpenAI-style `messages` ([{"role": "system"|"user"|"assistant", "content": str}])
or a `prompt` / `response` pair (optionally with a `system` string). They are rendered

- with the tokenizer's own chat template (`chat_template` in tokenizer_config.json, or chat_template.jinja),
  through jinja2 the way transformers' `apply_chat_template` renders it; the ids are those of
  `apply_chat_template(messages, tokenize=True)` (the whole text, tokenized without added special tokens). An
  assistant turn's tokens are the ones its rendering adds after the rendering of everything before it with the
  generation prompt (so the end-of-turn token belongs to the turn and the model learns to stop);
- or with a plain `--prompt-template` such as "User: {prompt}\\nAssistant: " for tokenizers without a template:
  system and user contents go through the template, each assistant content is followed by the EOD token.

Multi-turn: every assistant turn is a response conditioned on all turns before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import MegaDLMsError
from .tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")
CHAT_KEY = "chat"


class ChatError(MegaDLMsError, ValueError):
    """A chat record or template is unusable; the message says which and what to change."""


class BadRecord(ChatError):
    """One record is malformed (its line is reported, or skipped with --skip-bad-lines)."""


# --------------------------------------------------------------------------- records


def record_messages(obj: Any) -> list[dict[str, str]]:
    """The messages of one parsed jsonl record, validated; BadRecord says what is wrong."""
    if not isinstance(obj, dict):
        raise BadRecord(f"a JSON {type(obj).__name__}, expected an object with 'messages' or 'prompt'/'response'")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadRecord(f"'messages' must be a non-empty list of {{role, content}} objects, got "
                            f"{type(msgs).__name__}")
    elif "prompt" in obj or "response" in obj:
        for k in ("prompt", "response"):
            if k not in obj:
                raise BadRecord(f"has 'prompt'/'response' but lacks {k!r}")
        msgs = [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["response"]}]
        if "system" in obj:
            msgs.insert(0, {"role": "system", "content": obj["system"]})
    else:
        raise BadRecord(f"lacks 'messages' and 'prompt'/'response' (present keys: {sorted(obj)[:10]})")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRecord(f"message {i} is a {type(m).__name__}, expected an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadRecord(f"message {i} has unknown role {role!r}; roles are {list(ROLES)}")
        if not isinstance(content, str):
            raise BadRecord(f"message {i} ({role}) has content of type {type(content).__name__}, expected a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("has no assistant turn: nothing to train on")
    return out


# --------------------------------------------------------------------------- templates


def load_chat_template(folder: str | Path | None) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's `chat_template` (a string,
    or a list of named templates whose 'default' is taken); None when it has none."""
    if folder is None:
        return None
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg_file = folder / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    try:
        tpl = json.loads(cfg_file.read_text(encoding="utf-8")).get("chat_template")
    except json.JSONDecodeError as e:
        raise ChatError(f"cannot parse {cfg_file}: {e}") from e
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def _special_tokens(folder: Path | None) -> dict[str, str]:
    """bos/eos/unk/pad/mask token strings of tokenizer_config.json (the template variables transformers passes)."""
    if folder is None or not (folder / "tokenizer_config.json").is_file():
        return {}
    conf = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token"):
        v = conf.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out


def _compile_template(source: str) -> Any:
    """A jinja2 template compiled in the environment transformers uses for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatError(f"the chat template does not parse (line {e.lineno}: {e.message}); fix it or pass "
                        "--prompt-template") from e


class ChatRenderer:
    """Renders message lists to (ids, loss mask) with `tokenizer`; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer, *, template: str | None = None, prompt_template: str | None = None):
        self.tokenizer = tokenizer
        self.prompt_template = prompt_template
        if prompt_template is not None:
            if "{prompt}" not in prompt_template:
                raise ChatError(f"--prompt-template {prompt_template!r} has no {{prompt}} placeholder; write e.g. "
                                "'User: {prompt}\\nAssistant: '")
            self._jinja = None
            return
        folder = tokenizer.source_dir
        source = template if template is not None else load_chat_template(folder)
        if source is None:
            raise ChatError(f"the tokenizer in {folder} has no chat template (tokenizer_config.json 'chat_template' "
                            "or chat_template.jinja); pass --prompt-template 'User: {prompt}\\nAssistant: ' instead")
        self._jinja = _compile_template(source)
        self._vars = _special_tokens(Path(folder) if folder is not None else None)

    def render_text(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The template's text for `messages` (what apply_chat_template(tokenize=False) returns)."""
        import jinja2

        assert self._jinja is not None, "render_text needs a chat template; this renderer uses a prompt template"
        try:
            return self._jinja.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                      **self._vars)
        except jinja2.exceptions.TemplateError as e:
            raise BadRecord(f"the chat template refuses the record: {e}") from e

    def encode(self, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of one conversation; mask 1 on assistant tokens."""
        if self.prompt_template is not None:
            return self._encode_plain(messages, self.prompt_template)
        text = self.render_text(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render_text(messages[:i], add_generation_prompt=True)
            upto = self.render_text(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ChatError("the chat template does not render a conversation as a prefix of its continuation "
                                "(assistant turns cannot be located); pass --prompt-template instead")
            spans.append((len(before), len(upto)))
        enc = self.tokenizer.backend.encode(text, add_special_tokens=False)
        mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc.offsets]
        return list(enc.ids), mask

    def encode_prompt(self, prompt: str) -> list[int]:
        """Ids of a single user turn followed by the assistant's generation prompt (for sampling a response)."""
        if self.prompt_template is not None:
            text = self.prompt_template.format(prompt=prompt)
        else:
            text = self.render_text([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return self.tokenizer.backend.encode(text, add_special_tokens=False).ids

    def _encode_plain(self, messages: Sequence[dict[str, str]], prompt_template: str) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        ids: list[int] = []
        mask: list[int] = []
        system = ""
        for m in messages:
            if m["role"] == "system":
                system += m["content"] + "\n"
                continue
            if m["role"] == "user":
                piece = tok.backend.encode(system + prompt_template.format(prompt=m["content"]),
                                           add_special_tokens=False).ids
                system = ""
                ids += piece
                mask += [0] * len(piece)
            else:
                piece = tok.backend.encode(m["content"], add_special_tokens=False).ids + [tok.eod_id]
                ids += piece
                mask += [1] * len(piece)
        return ids, mask
