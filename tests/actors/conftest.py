"""Shared fixtures of the Ray-actor tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    """A random tiny DeepSeek checkpoint for the module (``CHECKPOINT_SEED`` in the module picks
    its weights; the tests compare against the model computed alone, so any seed works)."""
    from model.checkpoint import random_state_dict, save_checkpoint
    from model.config import named_config

    cfg = named_config("tiny")
    seed = getattr(request.module, "CHECKPOINT_SEED", 11)
    return save_checkpoint(tmp_path_factory.mktemp("tiny"), cfg, random_state_dict(cfg, seed=seed, std=0.06))
