"""`tide bench batch --url` against a server a user already runs (``tests/conftest.py``'s
``tide_up``, which has API keys): the interactive load alone and beside a batch, and nothing of
the bench's left on the server afterwards. Timings are never tested, only that they are there."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.cli import tide

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

KEY = "sk-client"


def _listed(url: str, what: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/{what}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_bench_batch_measures_a_running_server_and_leaves_nothing_behind(tide_up):
    files_before = {f["id"] for f in _listed(tide_up, "files")}
    batches_before = {b["id"] for b in _listed(tide_up, "batches")}
    r = tide("bench", "batch", "--url", tide_up + "/v1", "--clients", "1", "--requests", "3", "--max-tokens", "8",
             "--batch-lines", "24", "--repeats", "1", env={"OPENAI_API_KEY": KEY}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["url"] == tide_up and out["background_share"] is None and out["repeats"] == 1
    for case in ("alone", "beside_batch"):
        figures = out[case]
        assert figures["ttft_p50_ms"] > 0 and figures["itl_p99_ms"] > 0, figures
    assert out["alone"]["batch_lines_done"] == 0 and out["beside_batch"]["batch_lines_done"] >= 0
    assert isinstance(out["within_10pct"], bool) and out["ttft_p99_ratio"] > 0
    # the bench's batch ran (a line at least before the load) and was cancelled; its files are gone
    (batch,) = [b for b in _listed(tide_up, "batches") if b["id"] not in batches_before]
    assert batch["status"] in ("cancelled", "completed") and batch["request_counts"]["completed"] >= 1, batch
    assert {f["id"] for f in _listed(tide_up, "files")} == files_before


def test_bench_batch_names_a_server_that_refuses_it():
    """Checked before anything runs: a wrong key or a server that is not there is one error line."""
    # (the tide_up group's fixture is not needed: no server listens on port 9)
    r = tide("bench", "batch", "--url", "http://127.0.0.1:9", "--repeats", "1", timeout=120)
    assert r.returncode == 1 and "--url http://127.0.0.1:9" in r.stderr and "does not answer" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bench_batch_with_a_wrong_key_is_one_error_line(tide_up):
    r = tide("bench", "batch", "--url", tide_up, "--api-key", "sk-wrong", "--repeats", "1", timeout=120)
    assert r.returncode == 1 and "401" in r.stderr and "Traceback" not in r.stderr, r.stderr
