"""``deploy/local.py``'s rules that need no cluster (the cluster itself: ``test_cli_up.py``)."""

from __future__ import annotations

import pytest

from deploy.local import shared_cpu_threads


@pytest.mark.parametrize("args, threads", [
    ({}, 7),  # a lone replica computes with the machine but one core (for the proxy, the ingress, Ray)
    ({"replicas": 2, "decode_replicas": 1}, 2),  # 7 CPUs among three replicas
    ({"replicas": 16}, 1),  # never none
    ({"cpu_threads": 3}, 3),  # as given
    ({"replica_cpus": 2.0}, None),  # a reservation given: Ray's threads for it
    ({"device": "cuda"}, None),
])
def test_tide_up_shares_the_machines_cpus_among_its_replicas(monkeypatch, args, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert shared_cpu_threads(8.0, args) == threads


def test_omp_num_threads_set_stands(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert shared_cpu_threads(8.0, {}) is None
    assert shared_cpu_threads(8.0, {"cpu_threads": 4}) == 4


@pytest.mark.security
def test_keys_from_tide_api_keys_are_saved_for_tide_scale(monkeypatch, tmp_path):
    """`tide up` keeps the keys its shell's TIDE_API_KEYS gave: `tide scale` redeploys from the
    saved args in another shell, which must not serve the API open for lack of the variable.
    Keys given with --api-key stand."""
    from deploy.local import served_args

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    monkeypatch.setenv("TIDE_API_KEYS", "sk-night:ops")
    saved = served_args({"replicas": 1}, 2.0, "redis://127.0.0.1:1/0", own_redis=True)
    assert saved["api_keys"] == {"sk-night": "ops"} and saved["directory_password_env"]
    assert served_args({"api_keys": {"sk-cli": "a"}}, 2.0, "redis://x", own_redis=False)["api_keys"] == {"sk-cli": "a"}
    monkeypatch.delenv("TIDE_API_KEYS")
    assert served_args({}, 2.0, "redis://x", own_redis=False)["api_keys"] is None
