"""Night and day for an expert-parallel app on a simulated 3-node Ray cluster under a request
stream, with data-parallel attention replicas and routed experts on three shard actors (one per
node) that every replica uses. First with two replicas: the night lends the node that hosts only a
shard — EPLB re-plans the experts onto the two shards that stay, the weights move while the
replicas decode and both switch — and the day re-plans onto all three. Then with a replica on
every node: the night moves the experts off a node and drains its replica, the day brings both
back. No request fails and every answer equals the model computed alone."""

from __future__ import annotations

import time

import pytest

from tests.actors.tidal_streams import day_after_a_failure, three_node_app, under_a_stream
from tests.waiting import until

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CHECKPOINT_SEED = 23  # the weights of the `checkpoint` fixture (tests/actors/conftest.py)

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def serving(three_nodes, checkpoint, tmp_path_factory):
    home = tmp_path_factory.mktemp("tidal-ep")
    args = {"checkpoint": str(checkpoint), "replicas": 2, "replica_cpus": 1, "num_pages": 256,
            "expert_shards": 3, "cache_dir": str(home / "cache" / "{node}"), "usage_dir": str(home / "usage")}
    with three_node_app(args) as url:
        _wait_replicas_following(2)
        yield url, args


def _prompt(i: int) -> list[int]:
    return [256] + [(i * 37 + j * 11) % 250 + 3 for j in range(20 + i % 50)]


def _wait_replicas_following(n: int) -> None:
    import ray

    from deploy.ep_admin import find_ep_control

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the replicas are up and follow the control
        control = find_ep_control()
        if control is not None and len(ray.get(control.info.remote())["replicas"]) == n:
            return
        time.sleep(1)
    raise AssertionError(f"{n} replicas did not join the expert-parallel control")


def _placement(replicas: int) -> dict:
    """The control's placement, after checking that every replica serves it."""
    import ray

    from deploy.ep_admin import find_ep_control

    info = ray.get(find_ep_control().info.remote(), timeout=60)
    assert len(info["replicas"]) == replicas and set(info["replicas"].values()) == {info["version"]}, info
    return info


def _shard_nodes() -> list[str]:
    import ray

    from deploy.app import EXPERT_SHARD_NAME

    return [ray.get(ray.get_actor(EXPERT_SHARD_NAME.format(i), namespace="tideserve").info.remote())["node_id"]
            for i in range(3)]


def _lent_shard_is_empty(lent: str, shard_nodes: list[str]) -> bool:
    import ray

    from deploy.app import EXPERT_SHARD_NAME

    shard = ray.get_actor(EXPERT_SHARD_NAME.format(shard_nodes.index(lent)), namespace="tideserve")
    return ray.get(shard.info.remote())["versions"] == []


def test_night_moves_the_experts_off_a_shard_only_node_and_day_brings_them_back(serving, checkpoint):
    from deploy.tidal import lend_nodes, return_nodes

    url, args = serving
    shard_nodes = _shard_nodes()
    assert len(set(shard_nodes)) == 3, "the three shards should spread over the three nodes"
    assert _placement(2)["num_shards"] == 3

    def night_and_day(answers: list) -> None:
        night = lend_nodes(args, 1, train=None)
        lent = night["lent"][0]
        assert night["expert_shards"] == 2 and lent in shard_nodes and night["serving_replicas"] == 2
        assert _placement(2)["num_shards"] == 2
        assert _lent_shard_is_empty(lent, shard_nodes)  # its weights are gone
        served = len(answers)
        until(lambda: len(answers) > served, 120, "an answer at night")  # serving went on
        day = return_nodes(args)
        assert day["returned"] == [lent] and day["expert_shards"] == 3 and day["serving_replicas"] == 2
        assert _placement(2)["num_shards"] == 3
        served = len(answers)
        until(lambda: len(answers) > served, 120, "an answer in the morning")

    with day_after_a_failure(args):
        under_a_stream(url, checkpoint, _prompt, MAX_TOKENS, night_and_day)


def test_with_a_replica_on_every_node_night_lends_one_with_its_replica(serving, checkpoint):
    from ray import serve

    from deploy.app import build_app
    from deploy.tidal import lend_nodes, return_nodes

    url, args = serving
    args = {**args, "replicas": 3}
    serve.run(build_app(args), name="tideserve", route_prefix="/", blocking=False)
    _wait_replicas_following(3)
    shard_nodes = _shard_nodes()

    def night_and_day(answers: list) -> None:
        night = lend_nodes(args, 1, train=None, deadline_s=30)
        lent = night["lent"][0]
        assert night["expert_shards"] == 2 and night["serving_replicas"] == 2 and lent in shard_nodes
        assert _placement(2)["num_shards"] == 2  # the drained replica left the control too
        assert _lent_shard_is_empty(lent, shard_nodes)
        served = len(answers)
        until(lambda: len(answers) > served, 120, "an answer at night")
        day = return_nodes(args)
        assert day["returned"] == [lent] and day["expert_shards"] == 3 and day["serving_replicas"] == 3
        _wait_replicas_following(3)
        assert _placement(3)["num_shards"] == 3
        served = len(answers)
        until(lambda: len(answers) > served, 120, "an answer in the morning")

    with day_after_a_failure(args):
        under_a_stream(url, checkpoint, _prompt, MAX_TOKENS, night_and_day)
