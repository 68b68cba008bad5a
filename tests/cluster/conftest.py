"""The engine tests' model: the tiny config with random weights (seed 5), one per module; and
one with an MTP layer (the speculative decoding draft)."""

from __future__ import annotations

import pytest

from model.checkpoint import build_model, random_state_dict
from model.config import named_config


@pytest.fixture(scope="module")
def model():
    cfg = named_config("tiny")
    return build_model(cfg, random_state_dict(cfg, seed=5, std=0.1))


@pytest.fixture(scope="module")
def mtp_model():
    import dataclasses

    cfg = dataclasses.replace(named_config("tiny"), num_nextn_predict_layers=1)
    return build_model(cfg, random_state_dict(cfg, seed=7, std=0.1))
