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


# Multi-line, in the style of real checkpoints' templates: block tags on their own indented lines
# (Hugging Face renders with trim_blocks and lstrip_blocks), a namespace, loop controls, tojson
# of non-ASCII text, and a special token other than bos/eos.
MULTILINE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {% set ns.system = m['content'] %}
        {% continue %}
    {% endif %}
    {% if loop.index > 6 %}{% break %}{% endif %}
<|{{ m['role'] }}|>
    {{ m['content'] }}
{% endfor %}
{% if ns.system %}meta: {{ {'system': ns.system} | tojson }}{% endif %}
{% if add_generation_prompt %}
<|assistant|>{{ pad_token }}
{% endif %}"""

MESSAGES = [{"role": "system", "content": "be brief, ça va"}, {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "the tide"}, {"role": "user", "content": "is high"}]


def _hf_rendering(ckpt, template: str, messages: list[dict]) -> str:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                                 pad_token="<unk>")
    hf.chat_template = template
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("template", [TEMPLATE, MULTILINE])
def test_chat_template_renders_as_transformers_renders_it(ckpt, template):
    pytest.importorskip("transformers")
    from model.tokenizer import compile_chat_template

    expected = _hf_rendering(ckpt, template, MESSAGES)
    got = compile_chat_template(template)(messages=MESSAGES, add_generation_prompt=True, bos_token="<s>",
                                          eos_token="</s>", pad_token="<unk>")
    assert got == expected
    if template is MULTILINE:  # tojson keeps non-ASCII; a plain Jinja rendering keeps the block tags' whitespace
        import jinja2

        plain = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).from_string(template).render(
            messages=MESSAGES, add_generation_prompt=True, bos_token="<s>", eos_token="</s>", pad_token="<unk>")
        assert "ça va" in got and got != plain


def test_the_tokenizer_renders_with_the_checkpoints_special_tokens(ckpt):
    pytest.importorskip("transformers")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": {"content": "<unk>"}, "chat_template": MULTILINE}))
    tok = load_tokenizer(ckpt)
    assert tok.apply_chat_template(MESSAGES) == tok.encode(_hf_rendering(ckpt, MULTILINE, MESSAGES))


def test_a_template_cannot_reach_python_internals(ckpt):
    from model.tokenizer import compile_chat_template

    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="unsafe|access"):
        compile_chat_template(escape)(messages=[])
    with pytest.raises(ValueError, match="no system messages"):
        compile_chat_template("{{ raise_exception('no system messages') }}")(messages=[])
    with pytest.raises(ValueError, match="does not compile"):
        compile_chat_template("{% for m in messages %}")
