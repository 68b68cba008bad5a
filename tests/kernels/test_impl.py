"""``resolve_impl``: the kernel path a model gets on each device."""

from __future__ import annotations

import pytest

from kernels import resolve_impl


def test_auto_is_ref_on_cpu_and_triton_on_cuda():
    assert resolve_impl("auto", "cpu") == "ref"
    assert resolve_impl("auto", "cuda") == "triton"
    assert resolve_impl("ref", "cuda") == "ref"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton", "cpu") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_impl("triton", "cpu")


def test_unknown_impl_is_named():
    with pytest.raises(ValueError, match="'cuda-graph'"):
        resolve_impl("cuda-graph", "cpu")


def test_autotuning_tries_every_config_on_a_device_and_the_first_otherwise(monkeypatch):
    from kernels import tuned_configs

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TIDE_AUTOTUNE", "1")
    assert tuned_configs(["a", "b", "c"]) == ["a", "b", "c"]
    monkeypatch.setenv("TIDE_AUTOTUNE", "0")
    assert tuned_configs(["a", "b", "c"]) == ["a"]
    monkeypatch.setenv("TIDE_AUTOTUNE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuned_configs(["a", "b", "c"]) == ["a"]


def test_tiles_are_tuned_per_class_of_rows_and_of_context():
    """A decode-sized launch (64 rows, or one 128K sequence) gets an autotuner of its own: the
    tiles tuned on a prefill-sized launch of the same weights are not reused for it."""
    import torch

    from kernels import shape_class
    from kernels.fp8_gemm import FP8_MATMUL, M_CLASSES, fp8_linear, quantize_blocks
    from kernels.mla_decode import BATCH_CLASSES, CONTEXT_CLASSES, MLA_SPLIT
    from tests.kernels.triton_cases import DEVICE

    assert [shape_class(n, M_CLASSES) for n in (1, 64, 65, 4096, 10**6)] == [16, 64, 256, 4096, 4096]
    w = torch.randn(256, 128).to(DEVICE)
    q, s = quantize_blocks(w, (128, 128))
    for rows in (64, 300):
        fp8_linear(torch.randn(rows, 128).to(DEVICE), q, s)
    assert FP8_MATMUL(64) is not FP8_MATMUL(256) and {64, 256} <= set(FP8_MATMUL.classes)
    short = (shape_class(64, BATCH_CLASSES), shape_class(4096, CONTEXT_CLASSES))
    long = (shape_class(1, BATCH_CLASSES), shape_class(131072, CONTEXT_CLASSES))
    assert short != long and MLA_SPLIT(short) is not MLA_SPLIT(long)
