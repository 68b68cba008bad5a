"""DeepSeek-V3.2's and V4's chat encoding (``model.dsml``): the prompts their encoding rules write,
thinking on and off, tools and their results, and DSML calls parsed from an output, streamed."""

from __future__ import annotations

import json

import pytest

from model.dsml import DSML_FORMATS, DsmlCallStream, parse_dsml_calls, render_dsml
from model.tokenizer import HFTokenizer, load_tokenizer

V32, V4 = DSML_FORMATS["v3.2"], DSML_FORMATS["v4"]
B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
CALL = {"id": "c1", "type": "function", "function": {"name": "tide", "arguments": '{"port": "Brest", "days": 2}'}}
INVOKE = ('<｜DSML｜invoke name="tide">\n<｜DSML｜parameter name="port" string="true">Brest</｜DSML｜parameter>\n'
          '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>')
TOOLS = [{"type": "function", "function": {"name": "tide", "parameters": {"type": "object"}}}]


def test_a_chat_turn_thinking_off_and_on():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tide?"}]
    for fmt in (V32, V4):  # earlier reasoning is dropped; only the last turn opens a thought
        assert render_dsml(fmt, msgs) == f"{B}Be brief.{U}Hi{A}</think>Hello.{E}{U}Tide?{A}</think>"
        assert render_dsml(fmt, msgs, thinking=True) == f"{B}Be brief.{U}Hi{A}</think>Hello.{E}{U}Tide?{A}<think>"
    assert render_dsml(V4, msgs[:2], generation_prompt=False) == f"{B}Be brief.{U}Hi"
    high = render_dsml(V4, msgs[:2], thinking=True, reasoning_effort="high")
    assert high.startswith(B + "Reasoning Effort: Absolute maximum") and high.endswith(f"Be brief.{U}Hi{A}<think>")


def test_v32_tool_calls_and_their_results():
    msgs = [{"role": "user", "content": "Tide at Brest?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "high at 6"}]
    text = render_dsml(V32, msgs, TOOLS, thinking=True)
    system = text[len(B) : text.index(U)]
    assert system.startswith("\n\n## Tools") and '<functions>\n{"name": "tide"' in system
    assert text[text.index(U):] == (
        f"{U}Tide at Brest?{A}<think></think>\n\n<｜DSML｜function_calls>\n{INVOKE}\n</｜DSML｜function_calls>{E}"
        "\n\n<function_results>\n<result>high at 6</result>\n</function_results>\n\n<think>")


def test_v4_tool_results_are_a_user_turn_and_a_following_message_joins_it():
    msgs = [{"role": "user", "content": "Tide at Brest?"}, {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "high at 6"},
            {"role": "tool", "tool_call_id": "c1", "content": "low at 12"}, {"role": "user", "content": "And?"}]
    text = render_dsml(V4, msgs, TOOLS)
    assert "### Available Tool Schemas" in text
    assert text[text.index(U):] == (
        f"{U}Tide at Brest?{A}</think>\n\n<｜DSML｜tool_calls>\n{INVOKE}\n{INVOKE}\n</｜DSML｜tool_calls>{E}"
        f"{U}<tool_result>high at 6</tool_result>\n\n<tool_result>low at 12</tool_result>\n\nAnd?{A}</think>")


def test_bad_messages_name_themselves():
    with pytest.raises(ValueError, match="message 0: a tool result"):
        render_dsml(V4, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="message 1: role 'narrator'"):
        render_dsml(V32, [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}])
    with pytest.raises(ValueError, match="reasoning_effort 'extreme'"):
        render_dsml(V4, [], reasoning_effort="extreme")


@pytest.mark.parametrize("fmt", [V32, V4], ids=["v3.2", "v4"])
def test_calls_parse_from_an_output_streamed_in_any_pieces(fmt):
    block = fmt.calls_block
    out = f"Checking.\n\n<｜DSML｜{block}>\n{INVOKE}\n</｜DSML｜{block}>"
    content, calls = parse_dsml_calls(fmt, out)
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("tide", {"port": "Brest", "days": 2})]
    for size in (1, 3, 7):
        stream = DsmlCallStream(fmt)
        sent = "".join(stream.feed(out[i : i + size]) for i in range(0, len(out), size))
        rest, got = stream.finish()
        assert sent + rest == "Checking." and got == calls
    plain = DsmlCallStream(fmt)
    assert plain.feed("No calls.\n\n") + plain.finish()[0] == "No calls.\n\n"  # a held tail comes back at the end
    bad = out.replace('string="false">2<', 'string="false">two<')
    assert parse_dsml_calls(fmt, bad) == ("Checking.", [])  # a call whose value is not JSON is dropped


def test_a_v32_or_v4_checkpoint_without_a_template_uses_its_encoding(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = [B, E, U, A, "<think>", "</think>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<unk>", *specials, "Hi", "there"])}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": B, "eos_token": E}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    t = load_tokenizer(tmp_path)
    assert isinstance(t, HFTokenizer) and t.chat_format is V4
    ids = t.apply_chat_template([{"role": "user", "content": "Hi there"}], thinking=True)
    assert ids == [t._tok.token_to_id(x) for x in (B, U, "Hi", "there", A, "<think>")]
    assert isinstance(t.tool_call_stream(), DsmlCallStream)
    with pytest.raises(ValueError, match="chat_template_kwargs 'date'"):
        t.apply_chat_template([{"role": "user", "content": "Hi"}], date="today")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert load_tokenizer(tmp_path).chat_format is None  # V3 without a template: still an error
