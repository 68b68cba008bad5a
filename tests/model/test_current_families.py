"""DeepSeek's current families (V3.2's sparse attention, V4's hybrid compressed attention) match
transformers where their KV is not one dense tensor per token: past the indexer's top-k and the
compression windows, across chunk boundaries that fall inside a window, and in decode batches
that mix lengths."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_model
from tests.model.hf_checkpoints import make_hf_checkpoint

transformers = pytest.importorskip("transformers")

FAMILIES = ["v32_sparse_yarn", "v4_hybrid_yarn"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, ckpt)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, load_model(ckpt)


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _greedy_hf(hf, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        # an explicit mask: generate would otherwise take the prompt's pad-id tokens for padding
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        return hf.generate(prompt[None], attention_mask=mask, max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


def test_chunks_ending_inside_windows_give_the_whole_prompts_logits(pair):
    hf, ours = pair
    ids = _prompt(150, ours.cfg.vocab_size, seed=3)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    pool = ours.new_pool(10, 16)
    bounds = [0, 37, 38, 87, 150]  # 37 and 87 fall inside 4- and 16-token windows, 38 after one token
    got = torch.cat([ours.prefill(ids[a:b], pool, torch.arange(10), start=a, all_logits=True)
                     for a, b in zip(bounds, bounds[1:], strict=False)])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_a_decode_batch_of_mixed_lengths_gives_each_prompts_greedy_tokens(pair):
    """Three prompts (shorter than the top-k, about it, far past it) decode together for 40 steps,
    past several windows, each row at its own position."""
    hf, ours = pair
    prompts = [_prompt(n, ours.cfg.vocab_size, seed=10 + n) for n in (5, 17, 90)]
    steps, pages = 40, 9
    want = [_greedy_hf(hf, p, steps) for p in prompts]
    pool = ours.new_pool(pages * len(prompts), 16)
    tables = torch.arange(pages * len(prompts)).view(len(prompts), pages)
    tokens = [int(ours.prefill(p, pool, tables[b]).argmax()) for b, p in enumerate(prompts)]
    got = [[t] for t in tokens]
    for _ in range(steps - 1):
        positions = torch.tensor([len(p) + len(g) - 1 for p, g in zip(prompts, got, strict=True)])
        logits = ours.decode(torch.tensor([g[-1] for g in got]), pool, tables, positions)
        for b, t in enumerate(logits.argmax(-1).tolist()):
            got[b].append(t)
    assert got == want


def test_a_chunk_and_a_decode_batch_in_one_pass_equal_them_apart(pair):
    """``mixed``: a prompt's chunk rides with decode rows; both equal the calls made apart."""
    _, ours = pair
    a, b = _prompt(70, ours.cfg.vocab_size, seed=4), _prompt(50, ours.cfg.vocab_size, seed=5)
    results = []
    for together in (False, True):
        pool = ours.new_pool(16, 16)
        ta, tb = torch.arange(8), torch.arange(8, 16)
        ours.prefill(a[:40], pool, ta)
        first = int(ours.prefill(b, pool, tb).argmax())
        args = (torch.tensor([first]), pool, tb[None], torch.tensor([len(b)]))
        if together:
            chunk_logits, batch_logits = ours.mixed(a[40:], ta, 40, *args[:1], tb[None], args[3], pool)
        else:
            chunk_logits = ours.prefill(a[40:], pool, ta, start=40)
            batch_logits = ours.decode(*args)
        results.append((chunk_logits, batch_logits))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=0)


def test_a_long_prompt_in_query_blocks_gives_the_whole_prompts_logits(pair, monkeypatch):
    """V4 attends a chunk's queries a block at a time, each over its own window: blocks of 64
    across 300 tokens (every block boundary inside windows) give transformers' logits."""
    hf, ours = pair
    monkeypatch.setattr("model.v4.attention.QUERY_BLOCK", 64)
    ids = _prompt(300, ours.cfg.vocab_size, seed=9)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = ours.prefill(ids, ours.new_pool(20, 16), torch.arange(20), all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.slow  # Triton's interpreter: a few seconds
def test_the_triton_kernels_give_the_torch_paths_tokens(pair, tmp_path):
    """impl="triton" (here in Triton's interpreter): V3.2's sparse attention as one-token pages of
    the MLA decode kernel and its indexer's Triton scores, V4's decode-row top-k, give the tokens
    of the torch and C++ paths past the top-k."""
    hf, ours = pair
    hf.save_pretrained(tmp_path)
    triton_model = load_model(tmp_path, impl="triton")
    prompt = _prompt(24, ours.cfg.vocab_size, seed=13)
    from model.generate import generate

    assert generate(triton_model, prompt.tolist(), 8, eos_id=None) == generate(ours, prompt.tolist(), 8, eos_id=None)
