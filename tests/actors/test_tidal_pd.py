"""Night and day for a P/D app on a simulated 3-node Ray cluster under a request stream: two
prefill replicas and one decode replica, one per node. The night lends a prefill replica's node
(never the node of the decode pool's only replica): its replica drains and goes, the app serves
with one prefill and one decode replica; the day brings both pools back to their sizes. No
request fails and every answer equals the model computed alone."""

from __future__ import annotations

import time

import pytest

from tests.actors.tidal_streams import day_after_a_failure, three_node_app, under_a_stream
from tests.waiting import until

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CHECKPOINT_SEED = 31  # the weights of the `checkpoint` fixture (tests/actors/conftest.py)

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def serving(three_nodes, checkpoint, tmp_path_factory):
    home = tmp_path_factory.mktemp("tidal-pd")
    args = {"checkpoint": str(checkpoint), "replicas": 2, "decode_replicas": 1, "replica_cpus": 1,
            "num_pages": 256, "cache_dir": str(home / "cache" / "{node}"), "usage_dir": str(home / "usage")}
    with three_node_app(args) as url:
        _wait_reports(3)
        yield url, args


def _wait_reports(n: int) -> dict:
    import ray

    from actors.tidal import tidal_state

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        reports = ray.get(tidal_state().replica_reports.remote(max_age_s=2.0))
        if len(reports) == n:
            return reports
        time.sleep(0.5)
    raise AssertionError(f"{n} replicas did not report: {sorted(reports)}")


def _prompt(i: int) -> list[int]:
    return [256] + [(i * 31 + j * 7) % 250 + 3 for j in range(10 + i % 40)]


def test_night_lends_a_prefill_node_and_day_restores_both_pools(serving, checkpoint):
    from deploy.tidal import lend_nodes, return_nodes

    url, args = serving
    reports = _wait_reports(3)
    decode_node = next(r["node_id"] for name, r in reports.items() if "#LLMDecode#" in name)
    assert len({r["node_id"] for r in reports.values()}) == 3  # one replica per node

    def night_and_day(answers: list) -> None:
        night = lend_nodes(args, 1, deadline_s=30, train=None)
        assert night["serving_replicas"] == 1 and night["decode_replicas"] == 1
        assert night["lent"] != [decode_node]  # the decode pool's only replica stays
        left = _wait_reports(2)
        assert sorted("#LLMDecode#" in name for name in left) == [False, True]
        # the replicas that stay are the ones that served before (a redeploy that changed only
        # replica counts would otherwise have replaced every replica, and the ingress)
        assert set(left) < set(reports)
        served = len(answers)
        deadline = time.monotonic() + 120  # serving goes on at night, through both pools (slowly
        while len(answers) <= served + 1 and time.monotonic() < deadline:  # on a busy 2-core box)
            time.sleep(0.5)
        assert len(answers) > served + 1
        day = return_nodes(args)
        assert day["returned"] == night["lent"] and day["serving_replicas"] == 2 and day["decode_replicas"] == 1
        assert set(left) < set(_wait_reports(3))
        served = len(answers)
        until(lambda: len(answers) > served, 120, "an answer in the morning")

    with day_after_a_failure(args):
        under_a_stream(url, checkpoint, _prompt, MAX_TOKENS, night_and_day)
