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
