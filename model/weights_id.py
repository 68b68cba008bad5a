"""What a checkpoint's weights are, read without loading them (and without torch): their
digest and the form ``model.checkpoint.load_model`` will hold them in. Both are part of the
prompt cache's namespace, which the ingress computes too."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kernels import triton_interpreted

if TYPE_CHECKING:
    import torch

__all__ = ["FP8_WEIGHTS", "CheckpointError", "fp8_block_size", "keeps_fp8", "weights_digest", "weights_form"]

# What ``load_model`` does with an fp8 checkpoint's weights: "auto" keeps them as stored
# on CUDA and dequantizes them elsewhere; "keep" always keeps them (off CUDA only under Triton's
# interpreter: tests); "dequantize" always dequantizes them at load
FP8_WEIGHTS = ("auto", "keep", "dequantize")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config."""


def fp8_block_size(ckpt_dir: str | Path) -> tuple[int, int] | None:
    """The (rows, cols) block of an fp8 checkpoint's weight scales; None when it is not fp8."""
    raw = json.loads((Path(ckpt_dir) / "config.json").read_text()).get("quantization_config")
    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"quantization_config.quant_method {method!r} is not supported (fp8 is)")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"quantization_config.fmt {raw.get('fmt')!r} is not supported (e4m3 is)")
    block = raw.get("weight_block_size", [128, 128])
    if len(block) != 2 or min(block) < 1:
        raise CheckpointError(f"quantization_config.weight_block_size {block!r} is not two positive sizes")
    return int(block[0]), int(block[1])


def keeps_fp8(ckpt_dir: str | Path, device: str | torch.device, fp8_weights: str = "auto") -> bool:
    """Whether ``load_model`` keeps this checkpoint's weights in fp8 (see its ``fp8_weights``);
    the cache namespace depends on it (fp8 products compute other KV)."""
    if fp8_weights not in FP8_WEIGHTS:
        raise ValueError(f"unsupported fp8_weights {fp8_weights!r}; supported: {', '.join(FP8_WEIGHTS)}")
    if fp8_weights == "dequantize" or fp8_block_size(ckpt_dir) is None:
        return False
    on_cuda = str(device).split(":")[0] == "cuda"
    if fp8_weights == "keep" and not on_cuda and not triton_interpreted():
        raise ValueError("fp8_weights 'keep' needs CUDA (the fp8 GEMMs are Triton kernels) or TRITON_INTERPRET=1")
    return fp8_weights == "keep" or on_cuda


def weights_form(ckpt_dir: str | Path, device: str | torch.device, cpu_weights: str = "fp32",
                 fp8_weights: str = "auto") -> str:
    """How ``load_model`` holds the weights: "fp8" (kept as stored), "int8" or "fp32" (the
    model's dtype); units of KV computed with one form are not served to another."""
    return "fp8" if keeps_fp8(ckpt_dir, device, fp8_weights) else cpu_weights


def weights_digest(ckpt_dir: str | Path) -> str:
    """A stable id of a checkpoint's weights (part of the cache namespace).

    Hashes ``config.json`` and, per safetensors file, its name, size, header and last MiB, which
    changes whenever the weights do without reading hundreds of GB.
    """
    ckpt = Path(ckpt_dir)
    h = hashlib.sha256((ckpt / "config.json").read_bytes())
    for path in sorted(ckpt.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:32]
