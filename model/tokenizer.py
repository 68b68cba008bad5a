"""Tokenizers: Hugging Face ``tokenizer.json`` (+ chat template) or the built-in byte tokenizer.

The byte tokenizer maps each UTF-8 byte to its own id (0..255) and reserves 256 = BOS,
257 = EOS, 258 = ``<|user|>``, 259 = ``<|assistant|>``, 260 = ``<|system|>``; models whose vocab is
larger simply never produce the unused ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Protocol

from model.dsml import DSML_FORMATS, DsmlCallStream, DsmlFormat, render_dsml
from model.grammar import GrammarVocab
from model.tool_calls import ToolCallStream, format_tool_calls

__all__ = ["FIM_TOKENS", "ByteTokenizer", "HFTokenizer", "Tokenizer", "compile_chat_template", "load_tokenizer"]


FIM_TOKENS = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")  # DeepSeek's fill-in-the-middle markers


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes (what a client sees of it in logprobs; b"" for a special token)."""
        ...

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]:
        """Fill-in-the-middle prompt ids (DeepSeek's ``<｜fim▁begin｜>PREFIX<｜fim▁hole｜>SUFFIX<｜fim▁end｜>``
        after BOS); ValueError when the vocabulary lacks those tokens."""
        ...

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, /, *,
                            generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Messages (``role``, ``content``; an assistant's ``tool_calls``, a tool message's
        ``tool_call_id``) and the functions the model may call -> prompt ids ending where the
        assistant speaks (``generation_prompt`` False: after the last message). ``template_kwargs``:
        more variables for the template (the API's ``chat_template_kwargs``, e.g. DeepSeek-V3.1's
        ``thinking``)."""
        ...

    def think_ids(self) -> tuple[int, int] | None:
        """The ids of R1's ``<think>`` and ``</think>`` tokens, None when the vocabulary lacks them."""
        ...

    def grammar_vocab(self) -> GrammarVocab:
        """The vocabulary as structured output's grammars read it (``model.grammar``)."""
        ...

    def tool_call_stream(self):
        """A new parser of one output's tool calls in this model's format (``feed``, ``finish``:
        ``model.tool_calls.ToolCallStream``'s interface)."""
        ...


class ByteTokenizer:
    BOS, EOS, USER, ASSISTANT, SYSTEM = 256, 257, 258, 259, 260
    ROLE_IDS = {"user": USER, "assistant": ASSISTANT, "system": SYSTEM, "tool": USER}  # a tool's result: "tool: ..."
    vocab_floor = 261  # smallest vocab this tokenizer needs

    def __init__(self) -> None:
        self.bos_id = self.BOS
        self.eos_id = self.EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if 0 <= token < 256 else b""

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]:
        raise ValueError("this model's tokenizer has no fill-in-the-middle tokens")

    def grammar_vocab(self) -> GrammarVocab:
        return GrammarVocab(tuple(self.token_bytes(i) for i in range(self.vocab_floor)))

    def think_ids(self) -> tuple[int, int] | None:
        return None

    def tool_call_stream(self) -> ToolCallStream:
        return ToolCallStream()

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, /, *,
                            generation_prompt: bool = True, **template_kwargs) -> list[int]:
        ids = [self.BOS]
        if tools:  # the functions, as a system message of their own
            ids += [self.SYSTEM, *self.encode("functions: " + json.dumps(tools, ensure_ascii=False))]
        for msg in messages:
            role = msg.get("role")
            if role not in self.ROLE_IDS:
                raise ValueError(f"unknown chat role {role!r}; known: {sorted(self.ROLE_IDS)}")
            ids.append(self.ROLE_IDS[role])
            text = msg.get("content") or ""
            if role == "tool":
                text = f"tool {msg.get('tool_call_id') or ''}: {text}"
            if msg.get("tool_calls"):
                text += format_tool_calls(msg["tool_calls"])
            ids.extend(self.encode(text))
            if role == "assistant":
                ids.append(self.EOS)
        return ids + [self.ASSISTANT] if generation_prompt else ids


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library; chat template rendered with Jinja,
    or for a DeepSeek-V3.2 or V4 checkpoint without one, its encoding rules (``model.dsml``)."""

    def __init__(self, ckpt_dir: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(ckpt_dir / "tokenizer.json"))
        cfg_path = ckpt_dir / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(tcfg.get("bos_token"))
        self.eos_token = _token_str(tcfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = _default_template(tcfg.get("chat_template"))
        self.chat_format = None if self.chat_template else _dsml_format(ckpt_dir)
        # the template sees every named special token (bos_token, eos_token, pad_token, ...)
        self._special_tokens = {k: t for k, v in tcfg.items() if k.endswith("_token") and (t := _token_str(v))}
        self._template = None  # compiled on first use

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        # a token that is part of a character decodes to U+FFFD alone; its UTF-8 is reported then
        return self.decode([token]).encode("utf-8")

    def grammar_vocab(self) -> GrammarVocab:
        """Byte-level BPE (DeepSeek's) as its pieces, which xgrammar maps back to bytes; any other
        model as each token's decoded bytes. Special tokens are ""."""
        size = self._tok.get_vocab_size(with_added_tokens=True)
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        if decoder.get("type") == "ByteLevel":
            pieces = [self._tok.id_to_token(i) or "" for i in range(size)]
            return GrammarVocab(tuple("" if p in special else p for p in pieces), "byte_level")
        return GrammarVocab(tuple(b"" if self._tok.id_to_token(i) in special else self.token_bytes(i)
                                  for i in range(size)))

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]:
        begin, hole, end = (self._tok.token_to_id(t) for t in FIM_TOKENS)
        if begin is None or hole is None or end is None:
            raise ValueError(f"this model's tokenizer has no fill-in-the-middle tokens ({', '.join(FIM_TOKENS)})")
        bos = [self.bos_id] if self.bos_id is not None else []
        return [*bos, begin, *self.encode(prefix), hole, *self.encode(suffix), end]

    def think_ids(self) -> tuple[int, int] | None:
        from model.reasoning import THINK_CLOSE, THINK_OPEN

        ids = self._tok.token_to_id(THINK_OPEN), self._tok.token_to_id(THINK_CLOSE)
        return None if None in ids else ids

    def tool_call_stream(self) -> ToolCallStream | DsmlCallStream:
        return ToolCallStream() if self.chat_format is None else DsmlCallStream(self.chat_format)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, /, *,
                            generation_prompt: bool = True, **template_kwargs) -> list[int]:
        if self.chat_format is not None:
            return self._tok.encode(_render_dsml(self.chat_format, messages, tools, generation_prompt, template_kwargs),
                                    add_special_tokens=False).ids
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; use /v1/completions")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        taken = sorted(set(template_kwargs) & {"messages", "tools", "add_generation_prompt"})
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {taken[0]!r}")
        text = self._template(**{"bos_token": "", "eos_token": "", **self._special_tokens, **template_kwargs},
                              messages=messages, tools=tools, add_generation_prompt=generation_prompt)
        return self._tok.encode(text, add_special_tokens=False).ids


def compile_chat_template(source: str) -> Callable[..., str]:
    """A checkpoint's chat template as a function of its variables, rendered as Hugging Face
    ``transformers`` renders it (so a prompt's ids are the ones the model was trained on): block
    tags eat the newline after them and the whitespace before them (``trim_blocks``,
    ``lstrip_blocks``), ``break``/``continue`` work, ``tojson`` keeps non-ASCII text, and
    ``raise_exception``/``strftime_now`` exist. The
    template is untrusted input (it comes with the weights), so it runs in Jinja's immutable
    sandbox. A template error is a ``ValueError``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"the checkpoint's chat_template does not compile: {e}") from None

    def render(**context) -> str:
        try:
            return template.render(**context)
        except (jinja2.TemplateError, TypeError) as e:  # raise_exception, or a template that fails on these messages
            raise ValueError(f"the chat template failed on these messages: {e}") from None

    return render


def _dsml_format(ckpt_dir: Path) -> DsmlFormat | None:
    """The encoding rules of a DeepSeek-V3.2 or V4 checkpoint (by its config's model_type)."""
    cfg = ckpt_dir / "config.json"
    try:
        model_type = json.loads(cfg.read_text()).get("model_type") if cfg.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return {"deepseek_v32": DSML_FORMATS["v3.2"], "deepseek_v4": DSML_FORMATS["v4"]}.get(model_type)


DSML_KWARGS = ("thinking", "enable_thinking", "reasoning_effort")  # the chat_template_kwargs these encodings take


def _render_dsml(fmt: DsmlFormat, messages: list[dict], tools: list[dict] | None, generation_prompt: bool,
                 kwargs: dict) -> str:
    """``render_dsml`` with the API's ``chat_template_kwargs``: ``thinking`` (or ``enable_thinking``,
    a bool; off by default) and V4's ``reasoning_effort``."""
    unknown = sorted(set(kwargs) - set(DSML_KWARGS))
    if unknown:
        raise ValueError(f"chat_template_kwargs {unknown[0]!r} is not one this model's encoding takes "
                         f"({', '.join(DSML_KWARGS)})")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False))
    if not isinstance(thinking, bool):
        raise ValueError(f"chat_template_kwargs thinking must be true or false, got {thinking!r}")
    return render_dsml(fmt, messages, tools, thinking, generation_prompt, kwargs.get("reasoning_effort", "low"))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _default_template(value: object) -> str | None:
    """``chat_template`` is a string, or a list of named templates of which "default" is used."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _token_str(tok: object) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _raise(msg: str) -> None:
    import jinja2

    raise jinja2.TemplateError(msg)


def load_tokenizer(ckpt_dir: str | Path | None) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` when it has one, else the byte tokenizer."""
    if ckpt_dir is not None and (Path(ckpt_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(ckpt_dir))
    return ByteTokenizer()
