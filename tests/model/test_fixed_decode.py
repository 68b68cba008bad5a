"""Fixed-shape decode steps (model.fixed_decode): padded to a bucket, the same logits and latents as
``model.decode``; padding writes only the scratch page. CUDA graph capture is checked on a GPU."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import build_model, random_state_dict
from model.config import named_config
from model.fixed_decode import FixedShapeDecode, buckets_up_to
from model.model import DeepseekModel

PAGES, WIDTH, Z = 41, 8, 16  # page 40 is the scratch page
SCRATCH = PAGES - 1


@pytest.fixture(scope="module")
def model():
    cfg = named_config("tiny")
    m = build_model(cfg, random_state_dict(cfg, seed=3, std=0.08))
    if m.paged_kernel is None:
        pytest.skip("no paged CPU kernel (the extension did not build)")
    return m


def _prefilled(model, lengths: list[int], seed: int = 0):
    """A pool with ``lengths`` prompts in scattered pages (row j's pages: a permutation's)."""
    pool = model.new_pool(PAGES, Z)
    order = torch.randperm(SCRATCH, generator=torch.Generator().manual_seed(seed))[: len(lengths) * 5]
    tables = order.view(len(lengths), 5)
    gen = torch.Generator().manual_seed(seed + 1)
    for row, n in zip(tables, lengths, strict=True):
        model.prefill(torch.randint(0, model.cfg.vocab_size, (n,), generator=gen), pool, row)
    return pool, tables


def test_buckets_are_powers_of_two_then_the_largest():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(16) == [1, 2, 4, 8, 16]
    assert buckets_up_to(24) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        buckets_up_to(0)


@pytest.mark.parametrize("lengths", [[5], [1, 70, 33], [64, 16, 17, 2, 49]])
def test_a_padded_step_gives_the_logits_and_latents_of_model_decode(model, lengths):
    pool, tables = _prefilled(model, lengths)
    before = pool.data.clone()
    tokens, positions = torch.arange(3, 3 + len(lengths)), torch.tensor(lengths)
    want = model.decode(tokens, pool, tables, positions)
    want_pool = pool.data.clone()
    pool.data.copy_(before)
    step = FixedShapeDecode(model, pool, SCRATCH, WIDTH, buckets_up_to(8))
    assert step.bucket(len(lengths)) > len(lengths) or len(lengths) == 1
    got = step(tokens, tables, positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the new tokens' latents are model.decode's; every other page but the scratch page is as it
    # was: padding wrote nowhere else
    pages = lambda data: data.view(pool.num_layers, PAGES, Z, -1)  # noqa: E731
    torch.testing.assert_close(pages(pool.data)[:, :SCRATCH], pages(want_pool)[:, :SCRATCH], atol=1e-5, rtol=0)
    written = {int(tables[j, n // Z]) for j, n in enumerate(lengths)}
    untouched = [p for p in range(SCRATCH) if p not in written]
    assert torch.equal(pages(pool.data)[:, untouched], pages(before)[:, untouched])


def test_a_smaller_batch_after_a_larger_one_forgets_the_larger_ones_rows(model):
    pool, tables = _prefilled(model, [40, 20, 30, 10], seed=5)
    step = FixedShapeDecode(model, pool, SCRATCH, WIDTH, [4])
    step(torch.tensor([1, 2, 3, 4]), tables, torch.tensor([40, 20, 30, 10]))
    snapshot = pool.data.clone()
    want = model.decode(torch.tensor([9]), pool, tables[1:2], torch.tensor([21]))
    pool.data.copy_(snapshot)
    got = step(torch.tensor([9]), tables[1:2], torch.tensor([21]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # rows 1-3 of the buffers decode the scratch page again, not the last step's sequences
    assert step.positions[1:].tolist() == [0, 0, 0] and step.tables[1:, 0].tolist() == [SCRATCH] * 3


def test_the_paged_cpu_kernel_equals_the_gathered_attention(model, monkeypatch):
    pool, tables = _prefilled(model, [3, 50, 79], seed=7)
    snapshot = pool.data.clone()
    paged = model.decode(torch.tensor([1, 2, 3]), pool, tables, torch.tensor([3, 50, 79]))
    pool.data.copy_(snapshot)
    monkeypatch.setattr(DeepseekModel, "paged_kernel", property(lambda self: None))
    gathered = model.decode(torch.tensor([1, 2, 3]), pool, tables, torch.tensor([3, 50, 79]))
    torch.testing.assert_close(paged, gathered, atol=1e-5, rtol=0)


def test_bad_setups_and_batches_are_refused_with_the_reason(model):
    pool = model.new_pool(PAGES, Z)
    with pytest.raises(ValueError, match="scratch page 41 is not a page of the 41-page pool"):
        FixedShapeDecode(model, pool, PAGES, WIDTH, [1, 2])
    with pytest.raises(ValueError, match="buckets must be ascending"):
        FixedShapeDecode(model, pool, SCRATCH, WIDTH, [4, 2])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
            FixedShapeDecode(model, pool, SCRATCH, WIDTH, [1], capture=True)
    step = FixedShapeDecode(model, pool, SCRATCH, WIDTH, [1, 2])
    with pytest.raises(ValueError, match="a batch of 3 is larger than the largest bucket, 2"):
        step(torch.zeros(3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="block tables of 9 pages are wider than this step's 8"):
        step(torch.zeros(1, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    bf16 = build_model(model.cfg, {k: v.bfloat16() for k, v in random_state_dict(model.cfg, seed=3).items()})
    with pytest.raises(ValueError, match="needs a paged attention kernel"):
        FixedShapeDecode(bf16, bf16.new_pool(PAGES, Z), SCRATCH, WIDTH, [1])


@pytest.mark.gpu
def test_replayed_cuda_graphs_give_the_eager_steps_tokens():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = named_config("tiny")
    m = build_model(cfg, {k: v.cuda() for k, v in random_state_dict(cfg, seed=3, std=0.08).items()})
    lengths = [5, 70, 33]
    pool, tables = _prefilled(m, lengths, seed=11)
    snapshot = pool.data.clone()
    tokens, positions = torch.tensor([4, 5, 6]), torch.tensor(lengths)
    want = m.decode(tokens, pool, tables, positions)
    pool.data.copy_(snapshot)
    step = FixedShapeDecode(m, pool, SCRATCH, WIDTH, buckets_up_to(8), capture=True)
    assert step.captured == [1, 2, 4, 8]
    got = step(tokens, tables, positions)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for n in range(1, 9):  # every bucket replays, again and again, after other buckets
        rows = torch.arange(n) % 3
        pool.data.copy_(snapshot)
        want = m.decode(tokens[rows], pool, tables[rows], positions[rows])
        pool.data.copy_(snapshot)
        torch.testing.assert_close(step(tokens[rows], tables[rows], positions[rows]), want, atol=1e-4, rtol=0)


def test_the_steps_that_tune_before_a_capture_decode_distinct_tokens():
    """Issue 55: padding rows all decode token 0, so a capture's tuning steps routed every row to
    the same experts and the grouped GEMM was tuned on that; the tuning steps decode distinct
    tokens spread over the vocabulary instead (the capture itself is CUDA's, tested on a GPU)."""
    from model.fixed_decode import tuning_tokens

    for rows, vocab in ((64, 129280), (256, 102400), (8, 500)):
        ids = tuning_tokens(rows, vocab)
        assert ids.dtype == torch.long and len(set(ids.tolist())) == rows and 0 <= int(ids.min()) <= int(ids.max()) < vocab
    assert len(set(tuning_tokens(64, 32).tolist())) == 32  # a vocabulary smaller than the batch: every token
