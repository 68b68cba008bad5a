"""What a checkpoint's weights are, read without loading them (and without torch): their
digest and the form ``model.checkpoint.load_model`` will hold them in. Both are part of the
prompt cache's namespace, which the ingress computes too."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kernels import triton_interpreted

if TYPE_CHECKING:
    import torch

__all__ = ["FP8_WEIGHTS", "CheckpointError", "file_sha256", "fp8_block_size", "keeps_fp8", "stored_mtp_layers",
           "tensor_names", "weights_digest", "weights_form"]

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


def tensor_names(ckpt_dir: str | Path) -> set[str]:
    """The tensors a checkpoint stores (its index's, or its one file's header): nothing is read
    but names."""
    ckpt = Path(ckpt_dir)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    with open(ckpt / "model.safetensors", "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return set(json.loads(f.read(size))) - {"__metadata__"}


def stored_mtp_layers(cfg, names: set[str] | dict) -> int:
    """How many of the MTP layers ``cfg`` declares the checkpoint's tensor ``names`` hold, from
    the first (published conversions often drop them and keep the config): those
    ``load_model(mtp=True)`` loads, whose latents cache units carry."""
    v4 = not hasattr(cfg, "kv_lora_rank")  # DeepSeek-V4's are mtp.{k}. (model. in front as transformers writes)
    for k in range(cfg.num_nextn_predict_layers):
        if v4 and f"mtp.{k}.e_proj.weight" not in names and f"model.mtp.{k}.e_proj.weight" not in names:
            return k
        if not v4 and f"model.layers.{cfg.num_hidden_layers + k}.eh_proj.weight" not in names:
            return k
    return cfg.num_nextn_predict_layers


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
    """A stable id of a checkpoint's weights (part of the cache namespace): ``config.json`` and,
    per safetensors file, its name, size and the SHA-256 of all its bytes, so any change to any
    weight gives another id. A file's SHA-256 is read once per node and kept (``file_sha256``)."""
    ckpt = Path(ckpt_dir)
    files = sorted(ckpt.glob("*.safetensors"))
    with ThreadPoolExecutor(max(1, min(len(files), os.cpu_count() or 1, 8))) as pool:
        sums = list(pool.map(file_sha256, files))  # hashlib lets go of the GIL: files hash side by side
    h = hashlib.sha256((ckpt / "config.json").read_bytes())
    for path, sha in zip(files, sums, strict=True):
        h.update(f"{path.name}:{path.stat().st_size}:{sha}".encode())
    return h.hexdigest()[:32]


HASH_CHUNK = 8 << 20


def file_sha256(path: Path, memo_dir: Path | None = None) -> str:
    """The SHA-256 of a file's bytes, kept in ``memo_dir`` (default ``$TIDE_HOME/digests``)
    under its path with its size, inode, mtime and ctime: while none of them changes the file
    is not read again (a write changes its ctime, which no one can set back)."""
    from model.default import cache_root

    memo_dir = memo_dir or cache_root() / "digests"
    st = path.stat()
    stamp = [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    memo = memo_dir / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")
    try:
        kept = json.loads(memo.read_text())
        if kept.get("stamp") == stamp and isinstance(kept.get("sha256"), str):
            return kept["sha256"]
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    sha = h.hexdigest()
    try:  # kept for next time; a node that cannot write it reads the file each time
        memo_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"path": str(path.resolve()), "stamp": stamp, "sha256": sha}, f)
        os.replace(tmp, memo)
    except OSError:
        pass
    return sha
