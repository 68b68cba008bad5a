"""A checkpoint's own tokenizer.json and chat template are used when present."""

from __future__ import annotations

import json

import pytest

from model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture()
def ckpt(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(["hello world the tide is high", "the moon pulls the sea"],
                            trainers.WordLevelTrainer(special_tokens=specials))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}))
    return tmp_path


def test_tokenizer_json_and_chat_template(ckpt):
    tok = load_tokenizer(ckpt)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("the tide is high")
    assert len(ids) == 4 and tok.decode(ids) == "the tide is high"
    assert tok.bos_id == tok._tok.token_to_id("<s>") and tok.eos_id == tok._tok.token_to_id("</s>")
    chat = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert chat[0] == tok.bos_id and chat[-1] == tok._tok.token_to_id("<|assistant|>")
    assert tok._tok.token_to_id("hello") in chat
    assert tok.token_bytes(tok._tok.token_to_id("tide")) == b"tide" and tok.token_bytes(tok.eos_id) == b""


def test_without_tokenizer_json_the_byte_tokenizer_is_used(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_missing_chat_template_is_a_clear_error(ckpt):
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer(ckpt).apply_chat_template([{"role": "user", "content": "x"}])
