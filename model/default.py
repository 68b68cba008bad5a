"""The default model: a named small config whose weights are made deterministically from a seed
and saved in Hugging Face format on first use, so the main job runs with no download."""

from __future__ import annotations

import os
from pathlib import Path

from model.checkpoint import random_state_dict, save_checkpoint
from model.config import named_config

__all__ = ["default_checkpoint", "ensure_named_checkpoint"]

DEFAULT_MODEL = "tiny"
SEED = 20260101


def cache_root() -> Path:
    return Path(os.environ.get("TIDE_HOME", Path.home() / ".cache" / "tideserve"))


def ensure_named_checkpoint(name: str, root: Path | None = None, seed: int = SEED) -> Path:
    """Directory of the named config's checkpoint, created on first call (idempotent)."""
    cfg = named_config(name)  # raises on an unknown name
    ckpt = (root or cache_root()) / "models" / f"{name}-seed{seed}"
    if not (ckpt / "model.safetensors").is_file():
        save_checkpoint(ckpt, cfg, random_state_dict(cfg, seed=seed))
    return ckpt


def default_checkpoint(root: Path | None = None) -> Path:
    return ensure_named_checkpoint(DEFAULT_MODEL, root)
