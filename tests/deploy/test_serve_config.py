"""deploy/serve_config.yaml is a valid Serve config whose args build the app."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ray

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"


def test_serve_config_validates_against_serve_deploy_schema():
    from ray.serve.schema import ServeDeploySchema

    cfg = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = cfg.applications
    assert app.import_path == "deploy.app:build_app"


def test_its_args_are_app_args_and_build(tmp_path, monkeypatch):
    from deploy.app import AppArgs, build_app

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    AppArgs(**args)  # unknown or bad fields would raise
    app = build_app(args)
    assert app is not None
    with pytest.raises(ValueError, match="config.json"):
        build_app({"checkpoint": str(tmp_path)})


@pytest.mark.parametrize("config, weights, message", [
    ('{"model_type": "llama"}', True, "unsupported model_type 'llama'"),
    ("{not json", True, "Expecting property name"),
    (None, True, "no config.json"),
    ("tiny", False, "no model.safetensors"),
])
def test_a_bad_checkpoint_is_refused_before_any_replica_starts(tmp_path, config, weights, message):
    import json

    from deploy.app import build_app
    from model.config import named_config

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if config == "tiny":
        config = json.dumps(named_config("tiny").to_hf_dict())
    if config is not None:
        (ckpt / "config.json").write_text(config)
    if weights:
        (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=message) as e:
        build_app({"checkpoint": str(ckpt)})
    assert str(ckpt) in str(e.value)


def test_device_cuda_gives_each_replica_a_gpu(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from deploy.app import build_app

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    server = build_app({"device": "cuda", "dtype": "bfloat16"})._bound_deployment.init_args[0]
    assert server._bound_deployment.ray_actor_options["num_gpus"] == 1
    assert server._bound_deployment.init_args[0].device == "cuda"
    cpu = build_app({})._bound_deployment.init_args[0]
    assert cpu._bound_deployment.ray_actor_options["num_gpus"] == 0
    with pytest.raises(ValidationError, match="device"):
        build_app({"device": "tpu"})



def test_device_cuda_with_expert_shards_gives_each_shard_a_gpu(tmp_path, monkeypatch):
    import deploy.app
    from actors.replica_config import EPSection
    from deploy.app import build_app, shard_actor_options
    from deploy.app_args import AppArgs, gpus_needed

    assert shard_actor_options("cuda") == {"num_cpus": 0, "num_gpus": 1}
    assert shard_actor_options("cpu") == {"num_cpus": 0, "num_gpus": 0}
    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    asked = []  # the shard actors themselves need a Ray cluster (tests/actors/test_ep.py)
    monkeypatch.setattr(deploy.app, "_expert_shards", lambda ckpt, a: asked.append(a.device) or EPSection(None))
    server = build_app({"device": "cuda", "expert_shards": 2, "replicas": 3})._bound_deployment.init_args[0]
    assert asked == ["cuda"] and server._bound_deployment.init_args[0].device == "cuda"
    # data-parallel attention replicas over the shared shards: a GPU for each replica and each shard
    assert server._bound_deployment.num_replicas == 3
    assert gpus_needed(AppArgs(device="cuda", expert_shards=2, replicas=3)) == 5


def test_deployment_versions_change_with_what_replicas_are_built_from_not_with_counts(tmp_path, monkeypatch):
    """Serve replaces every replica of a deployment whose version changed: a day/night redeploy
    that only changes replica counts must keep the versions (and so the running replicas)."""
    from deploy.app import build_app

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))

    def versions(**args):
        ingress = build_app({"decode_replicas": 1, **args})._bound_deployment
        return (ingress._version, ingress.init_args[0]._bound_deployment._version,
                ingress.init_args[2]._bound_deployment._version)

    base = versions(replicas=2)
    assert all(base) and versions(replicas=3, decode_replicas=2) == base
    changed = versions(replicas=2, num_pages=64)
    assert changed[0] == base[0] and changed[1] != base[1] and changed[2] != base[2]
    assert versions(replicas=2, model_name="other")[0] != base[0]


def test_prefix_sharing_reaches_the_replicas(tmp_path, monkeypatch):
    from deploy.app import build_app

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    for value in (True, False):
        server = build_app({"prefix_sharing": value})._bound_deployment.init_args[0]
        assert server._bound_deployment.init_args[0].engine.prefix_sharing is value


def test_the_replicas_get_one_typed_config_with_every_app_arg(tmp_path, monkeypatch):
    """``build_app`` makes the replicas' ``ReplicaConfig`` once: every serving knob of the app
    reaches its section (the replica falls back on no default of its own)."""
    from actors.replica_config import ReplicaConfig
    from deploy.app import build_app

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    args = {"num_pages": 96, "max_num_seqs": 3, "max_prefill_tokens": 128, "itl_factor": 2.5, "itl_floor_ms": 7.5,
            "micro_batches": 2, "stream_batching_interval_ms": 20.0, "cpu_threads": 3, "admission": "second-sight",
            "ssd_gb": 2.0, "ram_mb": 7, "cache_layout": "unit", "cache_replicas": 3, "directory_url": "redis://127.0.0.1:1/0",
            "directory_namespace": "ns-7", "decode_replicas": 1, "cpu_weights": "int8"}
    ingress = build_app(args)._bound_deployment
    server, decode = ingress.init_args[0]._bound_deployment.init_args[0], ingress.init_args[2]._bound_deployment.init_args[0]
    assert isinstance(server, ReplicaConfig) and decode == server
    assert (server.stream_batching_interval_ms, server.cpu_threads) == (20.0, 3)
    e = server.engine
    assert (e.num_pages, e.max_num_seqs, e.max_prefill_tokens, e.itl_factor, e.itl_floor_ms, e.micro_batches,
            e.admission) == (96, 3, 128, 2.5, 7.5, 2, "second-sight")
    st = server.store
    assert (st.ssd_bytes, st.ram_bytes, st.layout, st.admission) == (2_000_000_000, 7 << 20, "unit", "second-sight")
    assert server.agents.store == st and server.agents.replicas == 3 and server.agents.directory == server.directory
    assert (server.directory.url, server.directory.namespace) == ("redis://127.0.0.1:1/0", "ns-7")
    assert ingress.init_args[1].directory == server.directory  # the ingress plans in the same namespace
    # int8 weights compute other KV: the replicas and the ingress hash units in one identity
    assert server.cpu_weights == "int8" == ingress.init_args[1].identity.cpu_weights
    assert ingress.init_args[1].identity == server.identity
    with pytest.raises(TypeError, match="ReplicaConfig"):
        from actors.llm_server import LLMServer

        LLMServer({"checkpoint": "x"})


def test_an_idle_replica_stops_without_waiting_out_serves_default_drain_poll(tmp_path, monkeypatch):
    """Every deployment checks its in-flight requests every DRAIN_POLL_S while stopping (Serve's
    2-s default is also the least time any replica takes to stop)."""
    from deploy.app import DRAIN_POLL_S, build_app

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    ingress = build_app({"decode_replicas": 1})._bound_deployment
    deployments = [ingress, ingress.init_args[0]._bound_deployment, ingress.init_args[2]._bound_deployment]
    assert [d.name for d in deployments] == ["OpenAIIngress", "LLMServer", "LLMDecode"]
    assert {d._deployment_config.graceful_shutdown_wait_loop_s for d in deployments} == {DRAIN_POLL_S} != {2.0}


@pytest.mark.security
def test_keys_from_the_environment_without_a_tenant_get_one_each(monkeypatch):
    """TIDE_API_KEYS entries without a tenant are isolated by the whole key: two keys with a
    common prefix (sk-proj-...) never share a cache or see each other's cached_tokens."""
    from deploy.app import api_keys_from_env

    monkeypatch.setenv("TIDE_API_KEYS", "sk-proj-aaaaaaaaaa,sk-proj-aaaaaaaaab,sk-x:team")
    keys = api_keys_from_env()
    assert keys["sk-x"] == "team"
    a, b = keys["sk-proj-aaaaaaaaaa"], keys["sk-proj-aaaaaaaaab"]
    assert a != b and "sk-proj" not in a + b  # neither the prefix nor the key is the tenant name


@pytest.mark.security
def test_keys_set_but_empty_are_refused_unless_serving_open_is_asked_for(monkeypatch):
    """An empty TIDE_API_KEYS (an empty Kubernetes Secret) would serve the API open: the app
    refuses to build, naming the variable that says so on purpose."""
    from deploy.app import api_keys_from_env

    monkeypatch.setenv("TIDE_API_KEYS", " ")
    with pytest.raises(ValueError, match="TIDE_ALLOW_NO_API_KEYS=1"):
        api_keys_from_env()
    monkeypatch.setenv("TIDE_ALLOW_NO_API_KEYS", "1")
    assert api_keys_from_env() is None
    monkeypatch.delenv("TIDE_API_KEYS")
    monkeypatch.delenv("TIDE_ALLOW_NO_API_KEYS")
    assert api_keys_from_env() is None


@pytest.mark.security
@pytest.mark.parametrize("limits, field", [({"max_token": 10}, "max_token"), ({"max_tokens": -1}, "max_tokens"),
                                           ({"max_body_bytes": 0}, "max_body_bytes")])
def test_a_misspelled_or_negative_limit_is_refused(limits, field):
    from pydantic import ValidationError

    from deploy.app import AppArgs

    with pytest.raises(ValidationError, match=field):
        AppArgs(limits=limits)


@pytest.mark.security
@pytest.mark.parametrize("seed, ok", [(2**63 - 1, True), (-(2**63), True), (2**64, False), (2**63, False)])
def test_seeds_outside_64_bits_are_a_validation_error(seed, ok):
    from pydantic import ValidationError

    from deploy.protocol import CompletionRequest

    if ok:
        assert CompletionRequest(model="m", prompt="x", seed=seed).seed == seed
    else:
        with pytest.raises(ValidationError, match="seed"):
            CompletionRequest(model="m", prompt="x", seed=seed)


@pytest.mark.security
def test_no_credential_travels_in_the_apps_init_args(tmp_path, monkeypatch):
    """Serve keeps every deployment's init args in Ray's GCS, which any Ray job (the night's
    training too) can read: the Redis password and the agent token go by name (an env var, a
    file) and each replica or agent reads them on its own node."""
    from deploy.app import build_app

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    password, token = "redis-pw-4f1c9e0d2b7a", "agent-token-a81e6f3c09d2"
    monkeypatch.setenv("TIDE_TEST_REDIS_PW", password)
    token_file = tmp_path / "agent.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    app = build_app({"directory_url": "redis://127.0.0.1:1/0", "directory_password_env": "TIDE_TEST_REDIS_PW",
                     "agent_token_file": str(token_file), "decode_replicas": 1})
    ingress = app._bound_deployment
    server, decode = ingress.init_args[0]._bound_deployment, ingress.init_args[2]._bound_deployment
    for cfg in (ingress.init_args[1], server.init_args[0], decode.init_args[0]):
        text = repr(cfg)
        assert password not in text and token not in text
    agents = server.init_args[0].agents
    assert agents.token_file == str(token_file) and agents.token is None
    assert server.init_args[0].directory.password_env == agents.directory.password_env == "TIDE_TEST_REDIS_PW"
    assert ingress.init_args[1].directory.password_env == "TIDE_TEST_REDIS_PW"
    # a file others can read, or a name that is not set, fails the deploy, not every replica
    token_file.chmod(0o644)
    with pytest.raises(ValueError, match="agent token file .* readable by others"):
        build_app({"agent_token_file": str(token_file)})
    with pytest.raises(ValueError, match="TIDE_TEST_UNSET"):
        build_app({"directory_password_env": "TIDE_TEST_UNSET"})


@pytest.mark.security
def test_a_deploy_without_an_agent_token_is_refused_and_none_is_made_up(tmp_path, monkeypatch):
    """Agents never serve unauthenticated, and the app never makes a token up: one it made would
    travel through Ray (its KV, the actors' arguments), which every Ray job reads."""
    from deploy.app import build_app

    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    monkeypatch.delenv("TIDE_AGENT_TOKEN_FILE", raising=False)
    with pytest.raises(ValueError, match="agent_token_file"):
        build_app({})
    token = tmp_path / "agent.token"
    token.write_text("a-token-of-at-least-16-bytes")
    token.chmod(0o600)
    server = build_app({"agent_token_file": str(token)})._bound_deployment.init_args[0]
    agents = server._bound_deployment.init_args[0].agents
    assert agents.token_file == str(token) and agents.token is None  # the path travels, not the token


def test_the_prefix_affinity_router_gets_its_bounded_load_from_the_app_args():
    from deploy.app import ROUTERS, AppArgs, _routed
    from deploy.prefill_router import PrefixAffinityRouter

    cfg = _routed(ROUTERS["prefix-affinity"], AppArgs(affinity_tokens=16, affinity_queue_ratio=1.5, affinity_queue_gap=64))
    assert cfg.request_router_kwargs == {"affinity_tokens": 16, "affinity_queue_ratio": 1.5, "affinity_queue_gap": 64}
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # (Serve builds it with its own arguments)
    router.initialize_state(**cfg.request_router_kwargs)
    assert (router.affinity_tokens, router.queue_ratio, router.queue_gap) == (16, 1.5, 64)
    assert _routed(ROUTERS["round-robin"], AppArgs()).request_router_kwargs == {}
    # each request gets the replica ranked for its own prompt: Serve's FIFOMixin would hand it to
    # the oldest request waiting, whose prefix hashes elsewhere (a hot prefix then spreads by chance)
    from ray.serve.request_router import FIFOMixin

    from deploy.prefill_router import CacheAwareRouter

    assert not issubclass(PrefixAffinityRouter, FIFOMixin) and not issubclass(CacheAwareRouter, FIFOMixin)
    with pytest.raises(ValueError, match="affinity_queue_ratio"):
        AppArgs(affinity_queue_ratio=0.5)
