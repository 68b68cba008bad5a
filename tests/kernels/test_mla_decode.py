"""MLA decode (Triton, split-K) against the torch reference over ragged, NaN-poisoned paged caches."""

from __future__ import annotations

import pytest
import torch

from kernels.mla_decode import MLA_CONFIGS, mla_decode, ref_mla_decode
from tests.kernels.triton_cases import DEVICE, TOLERANCES, poisoned_paged_kv


@pytest.mark.parametrize(
    "lens",
    [[1], [63], [64], [65], [1000], [1, 63, 64, 65], [1000, 3, 129]],
    ids=lambda lens: "-".join(map(str, lens)),
)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES, ids=lambda v: str(v).replace("torch.", ""))
def test_matches_reference(lens, dtype, atol, rtol):
    gen = torch.Generator().manual_seed(sum(lens))
    heads, r, p, z = 5, 60, 12, 16  # odd head count and widths: masks on every axis
    kv, table = poisoned_paged_kv(lens, z, r + p, dtype, gen)
    q_lat = torch.randn(len(lens), heads, r, generator=gen).to(dtype).to(DEVICE)
    q_rope = torch.randn(len(lens), heads, p, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = ref_mla_decode(q_lat, q_rope, kv, table, seq_lens, 0.11, z)
    assert not ref.isnan().any()
    for splits in (None, 1, 3):
        out = mla_decode(q_lat, q_rope, kv, table, seq_lens, 0.11, z, num_splits=splits)
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_more_splits_than_the_merge_weighs_at_once(monkeypatch):
    """A long context cut into more splits than ``MERGE_SPLITS``: the merge runs over them in
    chunks (its tiles stay small: no register spill at V3's lengths) and agrees with the reference,
    also where the short sequence leaves most splits empty."""
    import kernels.mla_decode as mla_module
    from kernels.mla_decode import MERGE_SPLITS

    gen = torch.Generator().manual_seed(11)
    lens = [4000, 70]
    kv, table = poisoned_paged_kv(lens, 16, 24 + 8, torch.float32, gen)
    q_lat = torch.randn(2, 3, 24, generator=gen).to(DEVICE)
    q_rope = torch.randn(2, 3, 8, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = ref_mla_decode(q_lat, q_rope, kv, table, seq_lens, 0.2, 16)
    tiles = []  # the merge's BLOCK_C at each launch
    real = mla_module._mla_decode_merge

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tiles.append(kwargs["BLOCK_C"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(mla_module, "_mla_decode_merge", Recording())
    for splits in (2 * MERGE_SPLITS + 7, 62):
        torch.testing.assert_close(mla_decode(q_lat, q_rope, kv, table, seq_lens, 0.2, 16, num_splits=splits), ref,
                                   atol=1e-5, rtol=1e-5)
    assert tiles == [MERGE_SPLITS, MERGE_SPLITS]  # the shape the compile check builds, whatever the splits


def test_page_size_and_many_heads():
    gen = torch.Generator().manual_seed(7)
    lens = [40, 7]
    kv, table = poisoned_paged_kv(lens, 4, 36 + 8, torch.float32, gen)
    q_lat = torch.randn(2, 33, 36, generator=gen).to(DEVICE)  # 33 heads: three head blocks
    q_rope = torch.randn(2, 33, 8, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(
        mla_decode(q_lat, q_rope, kv, table, seq_lens, 0.2, 4),
        ref_mla_decode(q_lat, q_rope, kv, table, seq_lens, 0.2, 4),
        atol=1e-4, rtol=1e-4,
    )


def test_one_token_pages_read_each_rows_chosen_latents():
    """DeepSeek-V3.2's sparse attention: a row's table lists the slots of its chosen latents (one
    token a page), in any order; the rest of the pool is poison."""
    gen = torch.Generator().manual_seed(11)
    kv = torch.full((300, 60 + 12), float("nan"))
    chosen = torch.randperm(300, generator=gen)[:70].view(2, 35)
    kv[chosen.reshape(-1)] = torch.randn(70, 72, generator=gen)
    q_lat, q_rope = torch.randn(2, 5, 60, generator=gen), torch.randn(2, 5, 12, generator=gen)
    kv, chosen, q_lat, q_rope = (t.to(DEVICE) for t in (kv, chosen, q_lat, q_rope))
    lens = torch.tensor([35, 9], device=DEVICE)
    want = ref_mla_decode(q_lat, q_rope, kv, chosen, lens, 0.3, 1)
    assert not want.isnan().any()
    torch.testing.assert_close(mla_decode(q_lat, q_rope, kv, chosen, lens, 0.3, 1), want, atol=1e-4, rtol=1e-4)


def test_bad_inputs_are_named():
    q = torch.zeros(2, 4, 8)
    qr = torch.zeros(2, 4, 4)
    kv = torch.zeros(32, 12)
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv \(32, 10\)"):
        mla_decode(q, qr, torch.zeros(32, 10), table, lens, 1.0, 16)
    with pytest.raises(TypeError, match="dtypes differ"):
        mla_decode(q.half(), qr, kv, table, lens, 1.0, 16)
    with pytest.raises(ValueError, match="block_table"):
        mla_decode(q, qr, kv, table.float(), lens, 1.0, 16)
    with pytest.raises(ValueError, match="page_size 5"):
        mla_decode(q, qr, kv, table, lens, 1.0, 5)


@pytest.mark.parametrize("config", MLA_CONFIGS, ids=lambda c: f"h{c.kwargs['BLOCK_H']}n{c.kwargs['BLOCK_N']}w{c.num_warps}")
def test_every_tuning_config_matches_reference(config):
    """The autotuner may pick any of ``MLA_CONFIGS`` on a device: each one computes the same."""
    gen = torch.Generator().manual_seed(3)
    lens = [1, 70, 200]
    heads, r, p, z = 33, 64, 16, 16  # more heads than the widest head block
    dtype, atol, rtol = TOLERANCES[2] if DEVICE == "cuda" else TOLERANCES[0]
    kv, table = poisoned_paged_kv(lens, z, r + p, dtype, gen)
    q_lat = torch.randn(len(lens), heads, r, generator=gen).to(dtype).to(DEVICE)
    q_rope = torch.randn(len(lens), heads, p, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = mla_decode(q_lat, q_rope, kv, table, seq_lens, 0.1, z, num_splits=2, config=config)
    torch.testing.assert_close(out.float(), ref_mla_decode(q_lat, q_rope, kv, table, seq_lens, 0.1, z).float(),
                               atol=atol, rtol=rtol)
