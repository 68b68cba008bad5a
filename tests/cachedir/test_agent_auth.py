"""Cache-agent call authentication (cachedir/agent/auth.py): the token never leaves the caller,
a captured signature cannot be used again, late or at another agent, and a listener that only
appears in the directory gets neither a credential nor a unit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cachedir.agent import agent_pb2, agent_pb2_grpc
from cachedir.agent.auth import AUTH_HEADER, WINDOW_S, Signer, Verifier, body_digest
from cachedir.agent.client import AgentClient, AgentError
from cachedir.agent.node_agent import AgentConfig, NodeAgent
from cachedir.agent.service import AgentBackend, ServerConfig, _Servicer
from cachedir.node_cache import CacheConfig, done
from cachedir.store import StoreConfig
from tests.cachedir.units import make_units

TOKEN = "cluster-agent-token-0123456789"
HAS = "/tideserve.cache.CacheAgent/Has"


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_signature_is_good_once_in_its_window_at_its_address():
    clock = Clock()
    signer, verifier = Signer(TOKEN, "node-a", clock), Verifier(TOKEN, "node-b", clock)
    verifier.addresses = {"10.0.0.2:7000"}
    md, nonce = signer.sign(HAS, "10.0.0.2:7000")
    assert TOKEN not in md[0][1]
    assert verifier.verify(md, HAS) == ("node-a", nonce)
    with pytest.raises(PermissionError, match="replayed"):
        verifier.verify(md, HAS)
    # for another method, another address, or under another token: refused
    for bad in (signer.sign("/tideserve.cache.CacheAgent/Push", "10.0.0.2:7000")[0],
                signer.sign(HAS, "10.0.0.3:7000")[0],
                Signer("another-token-0123456789", "node-a", clock).sign(HAS, "10.0.0.2:7000")[0],
                ((AUTH_HEADER, "node-a:1:2"),), ()):
        with pytest.raises(PermissionError):
            verifier.verify(bad, HAS)
    # a signature from further than the window away
    late, _ = Signer(TOKEN, "node-a", Clock(clock.t - WINDOW_S - 1)).sign(HAS, "10.0.0.2:7000")
    with pytest.raises(PermissionError, match="clock"):
        verifier.verify(late, HAS)
    # a renamed caller does not verify (its name is part of its key)
    name, rest = md[0][1].split(":", 1)
    with pytest.raises(PermissionError):
        verifier.verify(((AUTH_HEADER, f"node-x:{rest}"),), HAS)
    # nonces are forgotten once their window has passed, not before
    fresh, _ = signer.sign(HAS, "10.0.0.2:7000")
    verifier.verify(fresh, HAS)
    clock.t += 3 * WINDOW_S
    assert len(verifier._nonces) == 2
    verifier.verify(signer.sign(HAS, "10.0.0.2:7000")[0], HAS)
    assert len(verifier._nonces) == 1


def test_the_proof_binds_the_agent_to_the_callers_nonce():
    signer, verifier = Signer(TOKEN, "client"), Verifier(TOKEN, "node-b")
    _, nonce = signer.sign(HAS, "x:1")
    proof = verifier.proof(HAS, nonce)
    assert signer.proven(proof, HAS, nonce) == "node-b"
    assert signer.proven(proof, HAS, "another-nonce") is None
    assert signer.proven(proof, "/tideserve.cache.CacheAgent/Fetch", nonce) is None
    assert signer.proven(Verifier("another-token-0123456789", "node-b").proof(HAS, nonce), HAS, nonce) is None
    assert signer.proven((), HAS, nonce) is None
    with pytest.raises(ValueError, match="':'"):
        Signer(TOKEN, "a:b")


class _Recorder(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.metadata: list[dict] = []

    def intercept_service(self, continuation, details):
        self.metadata.append(dict(details.invocation_metadata))
        return continuation(details)


@pytest.fixture
def rogue():
    """A CacheAgent service without the token at an address a poisoned directory could list: it
    answers every call and keeps what it is sent."""
    recorder, received = _Recorder(), []
    backend = AgentBackend(read=lambda keys, requester: [("ssd", b"x" * 100)] * len(keys),
                           has=lambda keys: ["ssd"] * len(keys),
                           accept=lambda data, replace: received.append(data) or done(True),
                           stats=lambda: {"node_id": "rogue"})
    server = grpc.server(ThreadPoolExecutor(4), interceptors=[recorder])
    agent_pb2_grpc.add_CacheAgentServicer_to_server(_Servicer(backend), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", recorder, received
    server.stop(None)


def test_a_listener_without_the_token_learns_nothing_and_gets_no_unit(rogue):
    address, recorder, received = rogue
    units = make_units(list(range(64)))
    with AgentClient(address, TOKEN, timeout_s=1) as c:
        for call in (lambda: c.has([b"\0" * 16]), lambda: c.fetch([b"\0" * 16]), c.stats):
            with pytest.raises(AgentError, match="proof") as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        # a push waits for the proof before its first chunk; this peer answers only at the stream's
        # end, so the push ends unproven (or, on a busy machine, past its deadline)
        with pytest.raises(AgentError) as e:
            c.push([u.encode() for u in units])
        assert e.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert received == []
    assert len(recorder.metadata) == 4
    for md in recorder.metadata:
        assert not any(TOKEN in v for v in md.values() if isinstance(v, str))
        assert "authorization" not in md


def test_a_real_agent_proves_itself_and_refuses_replays(tmp_path):
    cfg = AgentConfig("node-a", CacheConfig(StoreConfig(tmp_path / "a", 1 << 30, fsync=False), ram_bytes=0),
                      ServerConfig(host="127.0.0.1", token=TOKEN), sync_every_s=3600, replication=None)
    agent = NodeAgent(cfg)
    try:
        units = make_units(list(range(128)))
        with AgentClient(agent.address, TOKEN, name="replica-1") as c:
            assert c.push([u.encode() for u in units]) == (2, 0)
            assert [f is not None for f in c.fetch([u.key for u in units])] == [True, True]
            assert c.stats()["push_accepted"] == 2
        channel = grpc.insecure_channel(agent.address)
        stub = agent_pb2_grpc.CacheAgentStub(channel)
        has = agent_pb2.HasRequest(keys=[units[0].key])
        body = body_digest(has.SerializeToString(deterministic=True))
        md, _ = Signer(TOKEN, "replica-1").sign(HAS, agent.address, body)
        assert list(stub.Has(has, metadata=md, timeout=5).tiers) == ["ssd"]
        with pytest.raises(grpc.RpcError) as e:  # the same header again
            stub.Has(has, metadata=md, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in e.value.details()
        elsewhere, _ = Signer(TOKEN, "replica-1").sign(HAS, "127.0.0.1:1", body)
        with pytest.raises(grpc.RpcError) as e:  # signed for another agent's address
            stub.Has(has, metadata=elsewhere, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # a fresh header signed for one request, sent with another's body (other keys)
        other, _ = Signer(TOKEN, "replica-1").sign(HAS, agent.address, body)
        with pytest.raises(grpc.RpcError) as e:
            stub.Has(agent_pb2.HasRequest(keys=[units[1].key]), metadata=other, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "request" in e.value.details()
        unsigned_body, _ = Signer(TOKEN, "replica-1").sign(HAS, agent.address)  # no body digest at all
        with pytest.raises(grpc.RpcError) as e:
            stub.Has(has, metadata=unsigned_body, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
    finally:
        agent.close()
