"""GPU telemetry: absent GPUs are reported as absent, quietly; present ones with their numbers."""

from __future__ import annotations

import pytest

from actors.gpu import gpu_telemetry


def test_reports_absent_gpus_without_raising(caplog):
    import torch

    t = gpu_telemetry()
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs; see test_reports_present_gpus")
    assert t["available"] is False and t["gpus"] == [] and t["reason"]
    assert not caplog.records  # no noise


@pytest.mark.gpu
def test_reports_present_gpus():
    t = gpu_telemetry()
    assert t["available"] and t["gpus"][0]["memory_total_bytes"] > 0
