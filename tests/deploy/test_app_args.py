"""The app's arguments are checked without the app: ``tide up`` refuses bad ones before it
starts anything, and that check must not pay for importing torch, Ray or the replica."""

from __future__ import annotations

import subprocess
import sys


def test_the_args_and_their_gpus_come_without_torch_or_ray():
    code = ("import sys\n"
            "from deploy.app_args import AppArgs, gpus_needed\n"
            "assert gpus_needed(AppArgs(device='cuda', replicas=2, decode_replicas=1, expert_shards=2)) == 5\n"
            "assert gpus_needed(AppArgs(replicas=4)) == 0\n"
            "print(sorted(m for m in ('torch', 'ray', 'fastapi', 'numpy', 'actors.llm_server') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_every_default_has_one_source():
    """The app's arguments build the typed configs, and with nothing set they build each one's
    own defaults: no knob has a second default that disagrees."""
    import dataclasses

    from actors.replica_config import AgentSection, ReplicaConfig, StoreSection
    from cluster.engine_config import EngineConfig
    from deploy.app_args import AppArgs

    a = AppArgs()
    assert a.engine_config() == EngineConfig()
    assert a.store_section("/c") == StoreSection("/c")
    replica = {f.name: f.default for f in dataclasses.fields(ReplicaConfig)}
    assert a.stream_batching_interval_ms == replica["stream_batching_interval_ms"]
    assert a.cache_replicas == {f.name: f.default for f in dataclasses.fields(AgentSection)}["replicas"]
    assert AppArgs(enable_cache=False).engine_config().prefix_sharing is False


def test_a_pace_reaches_the_engine_and_bad_ones_are_refused_by_name():
    import pytest
    from pydantic import ValidationError

    from cluster.engine_config import PassPace
    from deploy.app_args import AppArgs

    a = AppArgs(pace={"pass_ms": 5, "token_ms": 2.5, "row_ms": 0.5})
    assert a.engine_config().pace == PassPace(5.0, 2.5, 0.5)
    assert PassPace(5.0, 2.5, 0.5).seconds(tokens=100, rows=4) == pytest.approx(0.257)
    for bad, said in (({"token_ms": -1}, "token_ms must be a finite number of ms >= 0"), ({"tokens_ms": 1}, "tokens_ms")):
        with pytest.raises(ValidationError, match=said):
            AppArgs(pace=bad)
    with pytest.raises(ValidationError, match="emulates a device on the CPU"):
        AppArgs(device="cuda", pace={"pass_ms": 5})
