"""The default model: the ``tiny`` config with weights trained by ``tide train`` and shipped in the
package (``model/weights/tiny``, bf16, a few MB), so the main job answers with language-like
text and needs no download. Without the shipped weights (or for other named configs) the weights
are made deterministically from a seed and saved in Hugging Face format on first use."""

from __future__ import annotations

import os
from pathlib import Path

from model.config import WEIGHTS_FILE, named_config

__all__ = ["default_checkpoint", "ensure_named_checkpoint"]

DEFAULT_MODEL = "tiny"
SEED = 20260101


def cache_root() -> Path:
    return Path(os.environ.get("TIDE_HOME", Path.home() / ".cache" / "tideserve"))


def ensure_named_checkpoint(name: str, root: Path | None = None, seed: int = SEED) -> Path:
    """Directory of the named config's checkpoint, created on first call (idempotent)."""
    # torch is imported only when weights are made (the admin commands read cache_root)
    from model.checkpoint import random_state_dict, save_checkpoint

    cfg = named_config(name)  # raises on an unknown name
    ckpt = (root or cache_root()) / "models" / f"{name}-seed{seed}"
    if not (ckpt / WEIGHTS_FILE).is_file():
        save_checkpoint(ckpt, cfg, random_state_dict(cfg, seed=seed))
    return ckpt


SHIPPED = Path(__file__).resolve().parent / "weights" / DEFAULT_MODEL


def default_checkpoint(root: Path | None = None) -> Path:
    if (SHIPPED / WEIGHTS_FILE).is_file() and (SHIPPED / "config.json").is_file():
        return SHIPPED
    return ensure_named_checkpoint(DEFAULT_MODEL, root)
