"""Compute kernels below the model: CPU decode kernels (``cpu_gemv``) and Triton kernels for GPUs
(``mla_decode``, ``moe_route``, ``moe_grouped``, ``fp8_gemm``, ``unit_copy``, ``index_topk``), each beside a
same-signature pure-torch ``ref_*`` reference. ``resolve_impl`` picks between them."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the package's helpers are plain Python; the kernels import torch themselves
    import torch

__all__ = ["Impl", "TunedByShape", "resolve_impl", "shape_class", "triton_interpreted", "tuned_configs", "with_config"]

Impl = Literal["ref", "triton"]


def triton_interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``, tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tuned_configs(configs: list):
    """The tile configs a kernel's autotuner tries: all of them on a GPU; only the first in the
    interpreter or with ``TIDE_AUTOTUNE=0`` (the tests, which check every config separately
    instead of tuning each test shape)."""
    if triton_interpreted() or os.environ.get("TIDE_AUTOTUNE", "1") == "0":
        return configs[:1]
    return configs


def shape_class(n: int, bounds: tuple[int, ...]) -> int:
    """The class of a launch's size ``n`` its tiles are tuned for: the first bound >= n (the
    last one above them all)."""
    return next((b for b in bounds if n <= b), bounds[-1])


class TunedByShape:
    """One autotuner per shape class over the same JIT kernel: the tiles tuned on a decode-sized
    launch (64 rows, one long sequence) are not reused for a prefill-sized one, as a key of the
    kernel's fixed dimensions alone would. ``self(cls)`` is the autotuned kernel of class ``cls``."""

    def __init__(self, fn, configs: list, key: list[str]) -> None:
        self.fn, self.configs, self.key = fn, configs, key
        self._tuners: dict = {}
        self.last = None  # the class launched last

    def __call__(self, cls):
        self.last = cls
        tuner = self._tuners.get(cls)
        if tuner is None:
            import triton

            tuner = self._tuners[cls] = triton.autotune(self.configs, key=self.key)(self.fn)
        return tuner

    @property
    def classes(self) -> list:
        """The shape classes launched so far."""
        return list(self._tuners)


def with_config(kernel, config) -> tuple:
    """(kernel to launch, extra launch kwargs): the autotuned ``kernel`` as it is when ``config``
    is None, else its un-tuned JIT function with ``config``'s tiles, warps and stages."""
    if config is None:
        return kernel, {}
    return kernel.fn, {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def resolve_impl(impl: str, device: torch.device | str) -> Impl:
    """``auto`` -> ``triton`` on CUDA, ``ref`` elsewhere. ``triton`` off CUDA needs the
    interpreter (``TRITON_INTERPRET=1``); anything else raises ``ValueError`` naming the value."""
    import torch

    device = torch.device(device)
    if impl == "auto":
        return "triton" if device.type == "cuda" else "ref"
    if impl == "ref":
        return "ref"
    if impl == "triton":
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"impl='triton' on device {device.type!r} needs CUDA or TRITON_INTERPRET=1"
            )
        return "triton"
    raise ValueError(f"unknown impl {impl!r}; supported: auto, ref, triton")
