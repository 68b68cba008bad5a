"""Tokenizers: Hugging Face ``tokenizer.json`` (+ chat template) or the built-in byte tokenizer.

The byte tokenizer maps each UTF-8 byte to its own id (0..255) and reserves 256 = BOS,
257 = EOS, 258 = ``<|user|>``, 259 = ``<|assistant|>``, 260 = ``<|system|>``; models whose vocab is
larger simply never produce the unused ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes (what a client sees of it in logprobs; b"" for a special token)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Messages (``role``, ``content``) -> prompt ids ending where the assistant speaks."""
        ...


class ByteTokenizer:
    BOS, EOS, USER, ASSISTANT, SYSTEM = 256, 257, 258, 259, 260
    ROLE_IDS = {"user": USER, "assistant": ASSISTANT, "system": SYSTEM}
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

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        ids = [self.BOS]
        for msg in messages:
            role = msg.get("role")
            if role not in self.ROLE_IDS:
                raise ValueError(f"unknown chat role {role!r}; known: {sorted(self.ROLE_IDS)}")
            ids.append(self.ROLE_IDS[role])
            ids.extend(self.encode(msg.get("content") or ""))
            if role == "assistant":
                ids.append(self.EOS)
        ids.append(self.ASSISTANT)
        return ids


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library; chat template rendered with Jinja."""

    def __init__(self, ckpt_dir: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(ckpt_dir / "tokenizer.json"))
        cfg_path = ckpt_dir / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(tcfg.get("bos_token"))
        self.eos_token = _token_str(tcfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = tcfg.get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        # a token that is part of a character decodes to U+FFFD alone; its UTF-8 is reported then
        return self.decode([token]).encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; use /v1/completions")
        import jinja2

        env = jinja2.Environment(loader=jinja2.BaseLoader(), autoescape=False)
        env.globals["raise_exception"] = _raise
        text = env.from_string(self.chat_template).render(
            messages=messages, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            add_generation_prompt=True,
        )
        return self._tok.encode(text, add_special_tokens=False).ids


def _token_str(tok: object) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _raise(msg: str) -> None:
    raise ValueError(msg)


def load_tokenizer(ckpt_dir: str | Path | None) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` when it has one, else the byte tokenizer."""
    if ckpt_dir is not None and (Path(ckpt_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(ckpt_dir))
    return ByteTokenizer()
