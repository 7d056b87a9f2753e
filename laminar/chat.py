"""Chat rendering for agent episodes: OpenAI-style messages -> the text a model was tuned on -> token ids, and back.

    fmt = ChatFormat.load(tokenizer_dir)                     # the model folder's tokenizer and template
    text = fmt.render(messages, tools)                       # with the assistant's turn opened
    ids = fmt.encode(text)                                   # a continuation: nothing added
    fmt.decode(ids) == text                                  # lossless: special tokens kept as their text

Why it is shaped this way:
- An agent episode is recorded token-exact (roles/rollout/agent.py): each call's rendered context
  must *extend* what the episode recorded, compared as text (`decode` of the recorded tokens is a
  prefix of the new rendering), and only the new suffix is encoded. Re-encoding the whole
  conversation would re-tokenize the model's own output, which BPE may split differently from
  how it was sampled. So `decode` keeps special tokens and never cleans up spaces.
- The tiny test models have a byte tokenizer and no template. For them the format is a small
  ChatML-like template (BYTE_TEMPLATE) with three special markers, `<|pad|>`, `<|bos|>` and
  `<|end|>`, which encode to the byte tokenizer's ids 0, 1 and 2 (EOS): a turn ends with the
  model's EOS, exactly as a real model ends its turn with its end-of-turn token.
- A template that knows no tools or tool calls (SmolLM2's, the byte one) still serves them: the
  tool list goes into the system message, and an assistant message's tool calls are written as
  `<tool_call>{...}</tool_call>` after its content (the Hermes convention that laminar/toolcalls.py
  parses back out of the model's text).
- `message_key(message)` is what identifies an assistant message the gateway returned, so that
  an echo of it can be replaced by the exact text the model sampled.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from laminar.datasets import HFTokenizer, load_tokenizer
from laminar.toolcalls import render_tool_calls

BYTE_TEMPLATE = ("<|bos|>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TOOLS_PREAMBLE = ("You can call these tools: <tools>{tools}</tools>\nTo call one, write "
                  "<tool_call>{{\"name\": NAME, \"arguments\": {{...}}}}</tool_call>")


class ChatError(ValueError):
    """A conversation that cannot be rendered (a malformed message, a template that fails on it)."""


class ByteChatCodec:
    """The byte tokenizer (pad 0, bos 1, eos 2, byte b -> b + 3) with its special tokens written as
    `<|pad|>`, `<|bos|>`, `<|end|>`: text <-> ids, losslessly."""
    SPECIAL = {"<|pad|>": 0, "<|bos|>": 1, "<|end|>": 2}
    NAMES = {v: k for k, v in SPECIAL.items()}
    eos_id, offset = 2, 3

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            j = text.find("<|", i)
            if j < 0:
                j = len(text)
            out += [b + self.offset for b in text[i:j].encode("utf-8")]
            if j == len(text):
                break
            name = next((s for s in self.SPECIAL if text.startswith(s, j)), None)
            if name is None:  # a literal "<|" that names no special token
                out += [b + self.offset for b in b"<|"]
                i = j + 2
            else:
                out.append(self.SPECIAL[name])
                i = j + len(name)
        return out

    LONG = 256  # ids from this many on are decoded in one array pass (numpy's fixed cost pays off there)

    def decode(self, ids: Sequence[int], specials: bool = True) -> str:
        if len(ids) >= self.LONG:
            return self._decode_long(ids, specials)
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        off, parts, at = self.offset, [], 0
        for k in [k for k, t in enumerate(ids) if t < off]:  # the special tokens: each run between them at once
            parts.append(bytes([t - off for t in ids[at:k]]).decode("utf-8", errors="replace"))
            if specials:
                parts.append(self.NAMES.get(int(ids[k]), ""))
            at = k + 1
        parts.append(bytes([t - off for t in ids[at:]]).decode("utf-8", errors="replace"))
        return "".join(parts)

    def _decode_long(self, ids: Sequence[int], specials: bool) -> str:
        """As above, with numpy: the byte runs between special tokens are shifted and decoded at once."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.max() > 255 + self.offset:
            raise ValueError(f"token id {int(arr.max())} is not in the byte tokenizer's vocabulary "
                             f"(0..{255 + self.offset})")
        data = (arr - self.offset).astype(np.uint8).tobytes()  # at special tokens junk bytes, cut out below
        parts, at = [], 0
        for k in np.flatnonzero(arr < self.offset).tolist():
            parts.append(data[at:k].decode("utf-8", errors="replace"))
            if specials:
                parts.append(self.NAMES.get(int(arr[k]), ""))
            at = k + 1
        parts.append(data[at:].decode("utf-8", errors="replace"))
        return "".join(parts)


class ChatFormat:
    """One model's chat format: its template, and its tokenizer as a lossless text <-> ids codec."""

    def __init__(self, tokenizer, template: str | None, source: str, eos_id: int | None, name: str):
        self.tok, self.template, self.source, self.eos_id, self.name = tokenizer, template, source, eos_id, name
        self.supports_tools = "tools" in source
        self.supports_tool_calls = "tool_calls" in source
        self._byte = isinstance(tokenizer, ByteChatCodec)
        self._direct = self._byte and template == BYTE_TEMPLATE  # written without jinja (_byte_render)
        self._jinja = None

    @classmethod
    def load(cls, tokenizer_dir: str | None, chat_template: str = "auto") -> ChatFormat:
        """The format of a model folder: its tokenizer and its own template (`auto`), or a template
        file; a folder without tokenizer files gets the byte codec and BYTE_TEMPLATE."""
        tok = load_tokenizer(tokenizer_dir)
        if chat_template not in ("auto", "none"):
            path = Path(chat_template)
            if not path.is_file():
                raise ChatError(f"chat_template: {path}: no such template file (or auto)")
            template = path.read_text(encoding="utf-8")
        else:
            template = None
        if not isinstance(tok, HFTokenizer):
            return cls(ByteChatCodec(), template or BYTE_TEMPLATE, template or BYTE_TEMPLATE, ByteChatCodec.eos_id,
                       "byte")
        own = getattr(tok.tok, "chat_template", None)
        if template is None and not own:
            raise ChatError(f"{tokenizer_dir}: the tokenizer has no chat template; name a template file in "
                            "chat_template")
        return cls(tok.tok, template, template or own, tok.eos_id, str(tokenizer_dir))

    # -- text <-> ids ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as a continuation: no BOS or anything else added (the template writes
        the special tokens it wants, and they encode to their ids)."""
        if self._byte:
            return self.tok.encode(text)
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` with special tokens as written in the template, spaces untouched."""
        if self._byte:
            return self.tok.decode(ids)
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def display(self, ids: Sequence[int]) -> str:
        """What an API client sees of generated `ids`: special tokens (the end of turn) left out."""
        if self._byte:
            return self.tok.decode(ids, specials=False)
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # -- rendering --------------------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True,
               **variables) -> str:
        """The conversation as the model's text, the assistant's turn opened (`generation_prompt`);
        `variables` (e.g. `tool_choice`) are handed to the template as they are."""
        msgs = self.prepare(messages, tools)
        try:
            if self._direct:
                return _byte_render(msgs, generation_prompt)
            if self._byte:
                return self._jinja_render(msgs, tools, generation_prompt, variables)
            kw: dict[str, Any] = {"tools": tools} if tools and self.supports_tools else {}
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt,
                                                chat_template=self.template, **kw, **variables)
        except ChatError:
            raise
        except Exception as exc:  # the template's own error (a role it refuses, a missing field)
            raise ChatError(f"the chat template of {self.name} cannot render this conversation: {exc}") from None

    def _jinja_render(self, msgs: list[dict], tools, generation_prompt: bool, variables: dict) -> str:
        if self._jinja is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # late: jinja2, only for a model's own template
            self._jinja = ImmutableSandboxedEnvironment().from_string(self.template)
        return self._jinja.render(messages=msgs, tools=tools if self.supports_tools else None,
                                  add_generation_prompt=generation_prompt, **variables)

    def prepare(self, messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
        """Messages as the template can take them: text content (parts joined, None as ""), tool
        calls written into the content and tools into the system message where the template knows
        neither."""
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list")
        out = [self._message(i, m) for i, m in enumerate(messages)]
        if tools and not self.supports_tools:
            note = TOOLS_PREAMBLE.format(tools=json.dumps(tools, separators=(",", ":"), sort_keys=True))
            if out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out

    def _message(self, i: int, m: Any) -> dict:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"messages[{i}] must be an object with a string `role`")
        out = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id", "tool_calls")}
        out["content"] = content_text(m.get("content"), f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls and not self.supports_tool_calls:
            out["content"] += render_tool_calls(calls)
            del out["tool_calls"]
        return out


def _byte_render(msgs: list[dict], generation_prompt: bool) -> str:
    """BYTE_TEMPLATE's text, written directly: each message's turn depends on that message alone (no
    position, no look-ahead), so a plain join writes exactly what the template writes (the tests
    compare the two on many conversations), without jinja's ~30 us a call on an episode's sixth call."""
    turns = "".join([f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in msgs])
    return f"<|bos|>{turns}<|assistant|>\n" if generation_prompt else f"<|bos|>{turns}"


class GrowingText:
    """The decoded text of a token sequence that only grows (an episode's recording), decoding only
    what was appended since the last call, back to the last special token before it: the byte
    codec's decoding starts afresh after each special token, so the text up to one never changes
    as tokens are appended (a character split across the end is decoded again whole). Exactly
    `fmt.decode(ids)`. Other tokenizers (whose decoding may join pieces across any boundary)
    decode the whole sequence each time.

        text = memo.decode(ids, key)   # key: what the sequence is (a new key starts over)
    """

    def __init__(self, fmt: ChatFormat):
        self.fmt, self.key = fmt, None
        self.n, self.text = 0, ""    # the first n ids (ending at a special token) and their text

    def decode(self, ids: Sequence[int], key: Any = None) -> str:
        if not self.fmt._byte:
            return self.fmt.decode(ids)
        if key != self.key or len(ids) < self.n or (self.n and ids[self.n - 1] >= ByteChatCodec.offset):
            self.key, self.n, self.text = key, 0, ""
        rest = ids[self.n:]
        cut = len(rest)
        while cut and rest[cut - 1] >= ByteChatCodec.offset:  # back to the last special token
            cut -= 1
        if cut:
            self.text += self.fmt.decode(rest[:cut])
            self.n += cut
        return self.text + self.fmt.decode(rest[cut:])


def content_text(content: Any, where: str = "content") -> str:
    """A message's content as text: a string, None (""), or a list of parts whose text ones are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for p in content:
            if isinstance(p, str):
                texts.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str):
                texts.append(p["text"])
            else:
                raise ChatError(f"{where}: only text parts are supported")
        return "".join(texts)
    raise ChatError(f"{where}: must be a string, a list of text parts, or null")


def _canonical_args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def message_key(message: dict) -> str:
    """An assistant message's identity: its text content and its calls' names and arguments (ids,
    whitespace of the arguments' JSON and key order left out: clients rebuild those)."""
    content = message.get("content")
    if not message.get("tool_calls") and isinstance(content, str):  # text only (most echoes): the same key, sooner
        return _TEXT_KEY % _json_str(content.strip())
    calls = [(fn.get("name"), _canonical_args(fn.get("arguments")))
             for c in message.get("tool_calls") or [] if isinstance(c, dict)
             for fn in [c.get("function", c)] if isinstance(fn, dict)]
    return _KEY.encode({"content": (content_text(message.get("content")) or "").strip(), "calls": calls})


_KEY = json.JSONEncoder(sort_keys=True)  # one encoder: json.dumps with an option builds one per call
_TEXT_KEY = '{"calls": [], "content": %s}'  # _KEY's text of a message without calls, its string put in
_json_str = json.encoder.encode_basestring_ascii  # how _KEY writes a string (ensure_ascii)
