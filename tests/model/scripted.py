"""A scripted checkpoint: a real DeepSeek-V3 checkpoint (config.json, safetensors, tokenizer.json
with a chat template) whose weights make greedy decoding say a fixed script after the assistant
marker. Every layer's output projections are zero, so the hidden state at the last layer is the
current token's embedding; ``lm_head`` maps each script token's embedding to the next one. The
engine, the caches and the server run it as any other model, so a test can see what the server
does with an output it chose (tool calls, say) without trained weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from model.checkpoint import random_state_dict, save_checkpoint
from model.config import named_config
from model.tokenizer import FIM_TOKENS

TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>{{ tools | tojson }}{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", *FIM_TOKENS]


def make_scripted_checkpoint(out_dir: Path, words: list[str], scripts: dict[str, list[str]],
                             template: str = TEMPLATE, added: tuple[str, ...] = ()) -> Path:
    """``words``: ordinary vocabulary (prompts are made of them); ``scripts``: for a trigger token
    (``<|assistant|>``, say) the tokens said after it, in order, then ``</s>``; every script token
    once in all the scripts. A script token that is not a word is added as a non-special token, so
    it stays in the decoded text; a prompt that ends inside a script goes on from there.
    ``added``: more non-special tokens (a trigger the template writes, e.g. R1's ``<think>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()  # tokens join without spaces
    tok.add_special_tokens(SPECIALS)
    said = [t for script in scripts.values() for t in script]
    assert len(set(said)) == len(said) and not set(said) & set(scripts), "each script token once"
    tok.add_tokens([t for t in (*added, *said) if t not in vocab])
    chains = [[tok.token_to_id(t) for t in [trigger, *script, "</s>"]] for trigger, script in scripts.items()]

    cfg = dataclasses.replace(named_config("tiny"), bos_token_id=tok.token_to_id("<s>"),
                              eos_token_id=tok.token_to_id("</s>"))
    sd = random_state_dict(cfg, seed=3, std=0.02)
    for name in sd:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name].zero_()  # no layer adds anything to the residual stream
    h = cfg.hidden_size
    gen = torch.Generator().manual_seed(7)
    emb = torch.randn(cfg.vocab_size, h, generator=gen)
    emb = emb / emb.norm(dim=-1, keepdim=True) * h ** 0.5  # RMS 1: the final norm keeps it
    head = torch.zeros(cfg.vocab_size, h)
    for ids in chains:
        for cur, nxt in zip(ids, ids[1:], strict=False):
            head[nxt] += 20.0 * emb[cur] / h  # logit ~20 for the next script token, ~N(0, 1.25) for the rest
    sd["model.embed_tokens.weight"], sd["lm_head.weight"] = emb, head
    out_dir = Path(out_dir)
    save_checkpoint(out_dir, cfg, sd, {"tokenizer_config.json": json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})})
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir
