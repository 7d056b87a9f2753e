"""Chat templates where prompts are tokenized (laminar/datasets.py `prompt_encoder`): a prompt
dataset is rendered with the tokenizer folder's own chat template (`chat_template: auto`), a
template file (PATH) or not at all (`none`), with a configurable system prompt and the generation
prompt added; a chat-layout row keeps all of its messages. The prompt pool hands out the rendered
tokens; the SmolLM2 config renders at tokenization instead of pre-rendered text."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from laminar.config import load_config, parse_config
from laminar.datasets import DatasetError, Record, load_records, prompt_encoder
from laminar.protocol import TakeBatch
from tests.support import ROOT

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_QA = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}ANSWER:"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A character-level Hugging Face tokenizer folder with a ChatML chat template, written here."""
    from transformers import PreTrainedTokenizerFast
    d = tmp_path_factory.mktemp("tok")
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<unk>", pad_token="<|im_end|>", chat_template=CHATML).save_pretrained(d)
    return d


def ids_of(tok_dir: Path, text: str) -> list[int]:
    """The expected ids: special tokens whole, every other character one token."""
    from transformers import AutoTokenizer
    return list(AutoTokenizer.from_pretrained(str(tok_dir)).encode(text, add_special_tokens=False))


def test_chat_template_auto_renders_the_folders_template_with_system_prompt_and_generation_prompt(tok_dir):
    enc = prompt_encoder(str(tok_dir), "auto", system_prompt="Be brief.")
    rec = Record("p0", "What is 2+3?", "5")
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert enc.render(rec) == want
    assert enc.encode(rec).tolist() == ids_of(tok_dir, want)
    assert enc.encode(rec)[0] == 1 and enc.encode(rec).dtype.name == "int32"
    # without a system prompt: the user turn alone, the assistant's turn opened
    assert prompt_encoder(str(tok_dir)).render(rec) == \
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_none_and_path_and_a_chat_layout_row(tok_dir, tmp_path):
    rec = Record("p0", "What is 2+3?", "5")
    plain = prompt_encoder(str(tok_dir), "none")
    assert plain.render(rec) is None and plain.encode(rec).tolist() == ids_of(tok_dir, "What is 2+3?")
    tpl = tmp_path / "qa.jinja"
    tpl.write_text(PLAIN_QA)
    assert prompt_encoder(str(tok_dir), str(tpl)).render(rec) == "USER: What is 2+3?\nANSWER:"
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "system", "content": "Think."},
                                           {"role": "user", "content": "Hi"}], "answer": "x"}) + "\n")
    [row], _ = load_records(data)
    assert row.prompt == "Hi" and row.messages == (("system", "Think."), ("user", "Hi"))
    enc = prompt_encoder(str(tok_dir), "auto", system_prompt="Ignored: the row has its own.")
    assert enc.render(row) == "<|im_start|>system\nThink.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                              "<|im_start|>assistant\n"


def test_chat_template_auto_is_plain_text_for_the_byte_tokenizer_and_errors_name_the_setting(tmp_path):
    rec = Record("p0", "hi", "1")
    enc = prompt_encoder(None)  # the tiny models' byte tokenizer: no template, as before
    assert enc.render(rec) is None and enc.encode(rec).tolist() == [1, ord("h") + 3, ord("i") + 3]
    with pytest.raises(DatasetError, match="chat_template.*nope.jinja"):
        prompt_encoder(None, str(tmp_path / "nope.jinja"))
    (tmp_path / "t.jinja").write_text(PLAIN_QA)
    with pytest.raises(DatasetError, match="chat_template.*tokenizer_dir"):
        prompt_encoder(None, str(tmp_path / "t.jinja"))
    with pytest.raises(DatasetError, match="system_prompt"):
        prompt_encoder(None, "auto", system_prompt="Be brief.")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "x"}) + "\n")
    with pytest.raises(DatasetError, match="bad.jsonl: line 1.*content"):
        load_records(bad)


def test_chat_template_prompt_pool_hands_out_rendered_tokens(tok_dir, tmp_path):
    from laminar.testing.inproc_cluster import InprocCluster
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    cfg = parse_config({"run": {"workdir": str(tmp_path)}, "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                        "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "prompt_pool", "port": 6131}]}}},
                        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "seed": 0,
                                                  "tokenizer_dir": str(tok_dir), "system_prompt": "S"}}})

    async def main():
        c = InprocCluster(cfg)
        await c.start("prompt_pool")
        try:
            return await c.client("prompt_pool").call(TakeBatch("r", 2))
        finally:
            await c.close()
    batch = asyncio.run(main())
    t = batch.trajectories[0]
    want = f"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq{t.prompt_id}<|im_end|>\n<|im_start|>assistant\n"
    assert t.prompt_tokens.tolist() == ids_of(tok_dir, want)  # rows are numbered: prompt i is "q<i>"


def test_chat_template_smollm2_config_renders_at_tokenization():
    """configs/smollm2-math.yaml: plain-text word problems (asking for a boxed answer), rendered by
    SmolLM2's own template where the prompt pool and the evaluator tokenize them."""
    raw = yaml.safe_load((ROOT / "configs" / "smollm2-math.yaml").read_text())
    cfg = load_config(ROOT / "configs" / "smollm2-math.yaml")
    for role in ("prompt_pool", "evaluator"):
        assert raw["roles"][role]["chat_template"] == "auto"
        assert cfg.role_settings(role)["tokenizer_dir"] == "models/smollm2-math"
    make = (ROOT / "Makefile").read_text()
    assert "--chat-template" not in make and "word_problems $(SMOL_WP) --ask-boxed" in make
