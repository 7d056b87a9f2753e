"""The agent gateway's chat rendering and wire format, without a server (laminar/chat.py,
laminar/toolcalls.py, roles/gateway/openai_api.py):

- the byte tokenizer's chat format is lossless (its special markers encode to their ids), renders
  tools into the system message and an assistant's tool calls as `<tool_call>` text;
- a Hugging Face tokenizer with a ChatML template that knows no tools (SmolLM2's, built here with a
  small BPE so nothing is downloaded; the real SmolLM2 folder too when it is built) renders the
  same conversation, decodes losslessly, and a longer conversation's rendering extends the
  shorter one's, which is what the token-exact recording relies on;
- tool calls are parsed from text (and a malformed one is left as content), and a stream holds
  back `<tool_call>` markup;
- chunks merge into chat.completion / text_completion objects and stream events.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from laminar.roles.gateway.openai_api import ChunkStream, chat_completion, completion, merge

from laminar.chat import ByteChatCodec, ChatError, ChatFormat, GrowingText, message_key
from laminar.protocol import AgentCallReply, AgentChunk
from laminar.toolcalls import HoldBack, parse_tool_calls, render_tool_calls
from tests.support import ROOT

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
          "You are a helpful AI assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{\"x\": \"6*7\"}"}}
CONVERSATION = [{"role": "user", "content": "What is 6*7?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    """A Hugging Face tokenizer folder: byte-level BPE with ChatML's special tokens and template."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 6*7? The answer is 42.", "user assistant system tool calc"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML
    out = tmp_path_factory.mktemp("chatml")
    fast.save_pretrained(out)
    return out


def formats(chatml_dir) -> list[ChatFormat]:
    out = [ChatFormat.load(None), ChatFormat.load(str(chatml_dir))]
    smollm2 = ROOT / "models" / "smollm2"
    if (smollm2 / "tokenizer.json").exists():
        out.append(ChatFormat.load(str(smollm2)))
    return out


def test_byte_chat_codec_is_lossless_with_its_special_markers():
    c = ByteChatCodec()
    text = "<|bos|>héllo <|end|>\n<|x|> <|"
    ids = c.encode(text)
    assert ids[0] == 1 and 2 in ids and all(i >= 3 for i in ids if i not in (1, 2))
    assert c.decode(ids) == text
    assert c.decode(ids, specials=False) == "héllo \n<|x|> <|"


def test_a_growing_recordings_text_is_its_whole_decoding_at_every_length():
    """GrowingText (the extension check's decoding of an episode's recording, which only grows)
    gives exactly what decoding the whole sequence gives, however it grew: appends that cut a
    character, that hold no special token, that end on one; a new key starts over, as does a
    sequence that is not the one it knew."""
    fmt, rng = ChatFormat.load(None), np.random.default_rng(11)
    text = "<|bos|><|user|>\nhéllo wörld ✓ 𝄞<|end|>\n<|assistant|>\nsure: ü𝄞<|end|>\n" * 6
    whole = fmt.encode(text)
    for _ in range(20):
        memo, n = GrowingText(fmt), 0
        while n < len(whole):
            n = min(len(whole), n + int(rng.integers(0, 40)))
            assert memo.decode(whole[:n]) == fmt.decode(whole[:n])
        noise = rng.integers(0, 259, size=300).tolist()
        for n in (10, 50, 51, 120, 300):
            assert memo.decode(noise[:n], key=1) == fmt.decode(noise[:n])
    memo = GrowingText(fmt)
    assert memo.decode(whole) == text and memo.decode(whole[:7]) == fmt.decode(whole[:7])  # shorter: anew
    assert memo.decode(whole) == text
    other = fmt.encode("x" * len(whole))   # no special token where the text it holds ended: anew
    assert memo.decode(other) == "x" * len(whole)


def test_byte_chat_codec_decodes_as_token_by_token_at_every_length():
    """Below ByteChatCodec.LONG ids the decoding takes each run between special tokens at once, from
    LONG on it is one array pass: either way the same text as the per-token loop, split characters,
    stray continuation bytes and special tokens included, from a list or an array; an id outside
    the vocabulary is refused either way."""
    c, rng = ByteChatCodec(), np.random.default_rng(5)
    text = "<|bos|><|user|>\nhéllo wörld ✓ 𝄞<|end|>\n<|assistant|>\n" * 20
    whole = c.encode(text)
    assert len(whole) > 2 * c.LONG
    for n in (0, 1, 2, 7, 64, c.LONG - 1, c.LONG, c.LONG + 1, len(whole)):
        for start in (0, 1, 5):  # cut inside multi-byte characters too
            ids = whole[start:start + n]
            short = _loop(c, ids, True)
            assert c.decode(ids) == short and c.decode(np.asarray(ids, np.int32)) == short
            assert c.decode(ids, specials=False) == _loop(c, ids, False)
    for _ in range(100):
        ids = rng.integers(0, 259, size=int(rng.integers(0, 2 * c.LONG + 50))).tolist()
        assert c.decode(ids) == _loop(c, ids, True) and c.decode(ids, specials=False) == _loop(c, ids, False)
    assert c.decode(whole) == text
    for ids in ([259], [3] * (c.LONG - 1) + [259], [3] * c.LONG + [259]):
        with pytest.raises(ValueError):
            c.decode(ids)


def _loop(c: ByteChatCodec, ids, specials: bool) -> str:
    """The reference: one token at a time."""
    buf, parts = bytearray(), []
    for t in ids:
        if t >= c.offset:
            buf.append(t - c.offset)
            continue
        parts += [buf.decode("utf-8", errors="replace"), c.NAMES[t] if specials else ""]
        buf = bytearray()
    return "".join(parts + [buf.decode("utf-8", errors="replace")])


def test_episode_rendering_extends_and_decodes_losslessly(chatml_dir):
    for fmt in formats(chatml_dir):
        first = fmt.render(CONVERSATION[:1], TOOLS)
        full = fmt.render(CONVERSATION, TOOLS)
        assert '"name":"calc"' in first and "What is 6*7?" in first, fmt.name   # tools in the system message
        assert '<tool_call>{"name": "calc", "arguments": {"x": "6*7"}}</tool_call>' in full, fmt.name
        # the conversation so far, closed, is a prefix of the longer one: only the suffix is encoded
        closed = fmt.render(CONVERSATION[:2], TOOLS, generation_prompt=False)
        assert full.startswith(closed) and full.startswith(first), fmt.name
        for text in (first, full):
            ids = fmt.encode(text)
            assert fmt.decode(ids) == text, fmt.name
        # the model's turn ends with its end-of-turn token: decoded, the template's own text
        assert fmt.decode([fmt.eos_id]) in closed, fmt.name


def test_the_byte_templates_direct_rendering_is_the_templates(tmp_path):
    """The byte format's own template is written without jinja (`_byte_render`): on many conversations
    (roles of every kind, special markers, braces and jinja syntax in the text, content parts, tools,
    tool calls, with and without the assistant's turn opened) exactly what jinja writes from the same
    template. The reference renders through jinja: the same template with a comment, from a file."""
    from laminar.chat import BYTE_TEMPLATE
    path = tmp_path / "byte.jinja"
    path.write_text("{# the same template, so rendered by jinja #}" + BYTE_TEMPLATE, encoding="utf-8")
    direct, ref = ChatFormat.load(None), ChatFormat.load(None, str(path))
    assert direct._direct and not ref._direct
    rng = np.random.default_rng(3)
    words = ["hi", "<|end|>", "<|bos|>", "{{ x }}", "{% if %}", "\n", "\r\n", " ", "héllo ✓ 𝄞", "<|", "|>", "'",
             '"', "\\", "", "{#", "</tool_call>", "\t"]
    roles = ["user", "assistant", "system", "tool", "developer", "weird role {{ }}"]
    for _ in range(300):
        msgs = []
        for _ in range(int(rng.integers(1, 14))):
            text = "".join(rng.choice(words) for _ in range(int(rng.integers(0, 8))))
            m = {"role": str(rng.choice(roles)), "content": text}
            if rng.random() < 0.15:
                m["content"] = [{"type": "text", "text": text}, {"type": "text", "text": "b"}]
            if rng.random() < 0.1:
                m["content"] = None
            if m["role"] == "assistant" and rng.random() < 0.3:
                m["tool_calls"] = [CALL]
            if m["role"] == "tool":
                m["tool_call_id"] = "call_1"
            msgs.append(m)
        tools = TOOLS if rng.random() < 0.3 else None
        for gp in (True, False):
            assert direct.render(msgs, tools, generation_prompt=gp) == ref.render(msgs, tools, generation_prompt=gp)
    assert direct.render(CONVERSATION, TOOLS, tool_choice="auto") == ref.render(CONVERSATION, TOOLS, tool_choice="auto")


def test_messages_are_checked_and_content_parts_joined():
    fmt = ChatFormat.load(None)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "<|user|>\nab<|end|>" in fmt.render(parts)
    for bad in ([], [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}], "x"):
        with pytest.raises(ChatError):
            fmt.render(bad)


def test_tool_calls_parse_render_and_key():
    text = 'Let me see. <tool_call>{"name": "calc", "arguments": {"x": "6*7"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me see." and calls == [{"name": "calc", "arguments": '{"x": "6*7"}'}]
    assert parse_tool_calls("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])
    assert render_tool_calls([CALL]) == '<tool_call>{"name": "calc", "arguments": {"x": "6*7"}}</tool_call>'
    # an echo is the same message whatever the client did to ids, whitespace and key order
    echoed = {"role": "assistant", "tool_calls": [{"id": "other", "function": {"name": "calc",
                                                                              "arguments": '{ "x":"6*7" }'}}]}
    assert message_key(echoed) == message_key({"content": None, "tool_calls": [{"function": calls[0]}]})
    assert message_key(echoed) != message_key({"content": "", "tool_calls": []})


def test_a_text_only_messages_key_is_the_same_however_its_content_is_written():
    """A message without tool calls whose content is a string takes a shorter way to its key: the
    same key as its content written as parts, or with an empty list of calls (the general way),
    for any text (escapes, non-ASCII, surrounding whitespace); None and "" are one message."""
    rng = np.random.default_rng(8)
    alphabet = list("ab \n\t\"\\/<|>{}é✓𝄞\u2028\x00\x1f")
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(int(rng.integers(0, 30))))
        key = message_key({"role": "assistant", "content": text})
        assert key == message_key({"content": [{"type": "text", "text": text}]})
        assert key == message_key({"content": text, "tool_calls": []})
        assert json.loads(key) == {"content": text.strip(), "calls": []}
    assert message_key({"content": None}) == message_key({"content": ""}) == message_key({"content": "  "})
    assert message_key({"content": "a"}) != message_key({"content": "a", "tool_calls": [CALL]})


def test_streamed_text_holds_back_tool_call_markup():
    h = HoldBack()
    out = [h.feed(x) for x in ("Sure", " <tool", "_ca", 'll>{"name"', "}</tool_call> more")]
    assert "".join(out) + h.flush() == "Sure "
    h = HoldBack()
    assert h.feed("a <to") == "a " and h.feed("o late") == "<too late" and h.flush() == ""


def chunk(index, text, toks, finish="", calls="", top=""):
    return AgentChunk(index=index, text=text, token_ids=np.asarray(toks, np.int32),
                      logprobs=np.full(len(toks), -0.5, np.float32), finish_reason=finish, tool_calls=calls,
                      top_logprobs=top)


def test_chunks_merge_into_openai_objects_and_stream_events():
    reply = AgentCallReply("e", "c1", [], True, version=3, lineage=2, prompt_tokens=10, completion_tokens=5)
    calls = json.dumps([{"name": "calc", "arguments": '{"x": "1"}'}])
    chunks = [chunk(0, "Hi", [5, 6]), chunk(1, "Yo", [7]), chunk(0, "", [8], "tool_calls", calls),
              chunk(1, "!", [9, 2], "stop")]
    assert [m.text for m in merge(chunks)] == ["Hi", "Yo!"] and merge(chunks)[1].token_ids == [7, 9, 2]
    out = chat_completion("c1", "m", reply, chunks)
    a, b = out["choices"]
    assert out["object"] == "chat.completion" and out["system_fingerprint"] == "laminar-v3.2"
    assert a["finish_reason"] == "tool_calls" and a["message"]["tool_calls"][0]["function"]["name"] == "calc"
    assert b["message"]["content"] == "Yo!" and b["finish_reason"] == "stop" and b["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    top = json.dumps([["a", [["a", -0.1], ["b", -2.0]]]])
    text = completion("c1", "m", reply, [chunk(0, "a", [5], "length", top=top)])
    assert text["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.1, "b": -2.0}]
    cs = ChunkStream("chat", "c1", "m")
    events = [json.loads(e[len(b"data: "):]) for e in cs.events(AgentCallReply("e", "c1", chunks, True, 3))]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert events[2]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert events[3]["choices"][0]["finish_reason"] == "stop"
