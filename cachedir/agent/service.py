"""The ``CacheAgent`` gRPC service (``agent.proto``) over one node's ``NodeCache``.

Fetch streams each requested unit's encoded file in chunks of at most ``CHUNK_BYTES`` (a unit the
node lacks is one ``missing`` chunk, so the stream stays in request order); the caller verifies
every unit against its own key, tokens and namespace before using it. Push accepts units (engine
persistence and replication) through ``accept``, which re-verifies each one. Requests that are
malformed get ``INVALID_ARGUMENT`` with a message; with a token configured, a call that is not
signed with it (``cachedir.agent.auth``: the token itself is never sent) gets ``UNAUTHENTICATED``,
and every other call is answered first with the agent's proof that it holds the token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import grpc

from cachedir.agent import agent_pb2, agent_pb2_grpc
from cachedir.agent.auth import Verifier, body_digest
from cachedir.hashing import KEY_BYTES
from cachedir.layout import Loc

__all__ = ["CHUNK_BYTES", "MAX_KEYS", "AgentBackend", "ServerConfig", "start_server"]

CHUNK_BYTES = 8 << 20  # a DeepSeek-V3 unit (~4.3 MiB) travels as one message
MAX_KEYS = 4096
FETCH_GROUP = 16  # units a Fetch reads (and holds) at once before streaming them
MAX_UNIT_BYTES = 64 << 20  # a DeepSeek-V3 unit is ~4.3 MiB; anything far larger is not a unit


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the node's own address when other nodes must reach it; never 0.0.0.0 by default
    port: int = 0  # 0: any free port (the bound one is returned)
    token: str | None = None  # the cluster's agent token: calls must be signed with it (never sent)
    name: str = "agent"  # the name this agent proves itself under (its node id)
    advertise_hosts: tuple[str, ...] = ()  # hosts callers dial besides ``host`` (signatures name the address)
    tls_cert_chain: bytes | None = None  # PEM; with tls_private_key enables TLS
    tls_private_key: bytes | None = None
    tls_client_ca: bytes | None = None  # PEM; callers must present a certificate it signed (mutual TLS)
    threads: int = 8


@dataclass(frozen=True, slots=True)
class AgentBackend:
    """What the service needs from the node (``NodeAgent`` provides these)."""

    read: Callable[[Sequence[bytes], str], list[tuple[str, bytes] | None]]  # keys, requester
    has: Callable[[Sequence[bytes]], list[str]]
    accept: Callable[[bytes, bool], Future[bool]]  # one encoded unit, replace: stored (False: rejected)
    stats: Callable[[], dict]
    locate: Callable[[Sequence[bytes]], list[tuple[str, Loc] | None]] = lambda keys: [None] * len(keys)  # tier, where
    reserve: Callable[[Sequence[bytes], str], tuple[bytes, int]] = lambda keys, requester: (b"", 0)  # ticket, port


def _check_keys(keys: Sequence[bytes], context: grpc.ServicerContext) -> None:
    if len(keys) > MAX_KEYS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys in one call; at most {MAX_KEYS}")
    for i, k in enumerate(keys):
        if len(k) != KEY_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"key {i} has {len(k)} bytes; unit keys have {KEY_BYTES}")


class _Servicer(agent_pb2_grpc.CacheAgentServicer):
    def __init__(self, backend: AgentBackend) -> None:
        self.b = backend

    def Fetch(self, request, context) -> Iterator[agent_pb2.UnitChunk]:  # noqa: N802 - gRPC names
        """The units of ``keys``, read ``FETCH_GROUP`` at a time: what one call holds in memory
        is a group's bytes, however many keys it asks for."""
        keys = list(request.keys)
        _check_keys(keys, context)
        for start in range(0, len(keys), FETCH_GROUP):
            group = keys[start : start + FETCH_GROUP]
            yield from self._chunks(start, group, self.b.read(group, request.requester))

    @staticmethod
    def _chunks(start: int, keys: list[bytes], units: list[tuple[str, bytes] | None]) -> Iterator[agent_pb2.UnitChunk]:
        for i, found in enumerate(units, start):
            key = keys[i - start]
            if found is None:
                yield agent_pb2.UnitChunk(index=i, key=key, missing=True, last=True)
                continue
            tier, data = found
            view = memoryview(data)
            n = max(1, -(-len(view) // CHUNK_BYTES))
            for c in range(n):
                part = view[c * CHUNK_BYTES : (c + 1) * CHUNK_BYTES]
                if c == 0:
                    yield agent_pb2.UnitChunk(index=i, key=key, data=bytes(part), tier=tier,
                                              size=len(view), last=n == 1)
                else:
                    yield agent_pb2.UnitChunk(index=i, data=bytes(part), last=c == n - 1)

    def Has(self, request, context) -> agent_pb2.HasReply:  # noqa: N802
        keys = list(request.keys)
        _check_keys(keys, context)
        return agent_pb2.HasReply(tiers=self.b.has(keys))

    def Push(self, request_iterator, context) -> agent_pb2.PushReply:  # noqa: N802
        """Answers once every unit of the stream is stored or rejected: an accepted unit is
        readable (and on SSD) when the pusher learns of it."""
        stored: list[Future[bool]] = []
        rejected = 0
        parts: list[bytes] | None = None
        size = got = 0
        replace = False
        for chunk in request_iterator:
            if parts is None:
                if not chunk.size or chunk.size > MAX_UNIT_BYTES:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"a unit's first chunk must give its size (1..{MAX_UNIT_BYTES}), got {chunk.size}")
                parts, size, got, replace = [], chunk.size, 0, chunk.replace
            parts.append(chunk.data)
            got += len(chunk.data)  # a running count: summing every part per chunk was quadratic
            if got > size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unit {chunk.index} is longer than its size {size}")
            if chunk.last:
                if got == size:
                    stored.append(self.b.accept(b"".join(parts), replace))
                else:
                    rejected += 1
                parts = None
        if parts is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the stream ended inside a unit (no last chunk)")
        wait(stored, timeout=context.time_remaining())
        accepted = sum(f.done() and f.exception() is None and f.result() for f in stored)
        return agent_pb2.PushReply(accepted=accepted, rejected=rejected + len(stored) - accepted)

    def Stats(self, request, context) -> agent_pb2.StatsReply:  # noqa: N802
        return agent_pb2.StatsReply(json=json.dumps(self.b.stats()))

    def Reserve(self, request, context) -> agent_pb2.ReserveReply:  # noqa: N802
        keys = list(request.keys)
        _check_keys(keys, context)
        ticket, port = self.b.reserve(keys, request.requester)
        return agent_pb2.ReserveReply(ticket=ticket, port=port)

    def Locate(self, request, context) -> agent_pb2.LocateReply:  # noqa: N802
        keys = list(request.keys)
        _check_keys(keys, context)
        return agent_pb2.LocateReply(locations=[
            agent_pb2.Location() if found is None else
            agent_pb2.Location(path=str(found[1].path), offset=found[1].offset, length=found[1].length, tier=found[0])
            for found in self.b.locate(keys)])


class _SignedCalls(grpc.ServerInterceptor):
    """Lets through only calls signed by a holder of the agent token (``cachedir.agent.auth``),
    and answers each with this agent's proof before anything else."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        inner = _behaviour(handler)

        def behaviour(request, context):
            # a request message's digest is part of its signature; a streamed request signs none
            body = "" if handler.request_streaming else body_digest(request.SerializeToString(deterministic=True))
            try:
                _, nonce = self.verifier.verify(details.invocation_metadata, details.method, body)
            except PermissionError as e:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"cache agent: {e}")
            context.send_initial_metadata(self.verifier.proof(details.method, nonce))
            return inner(request, context)
        # the answer must have the method's own streaming shape
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[handler.request_streaming, handler.response_streaming]
        return make(behaviour, handler.request_deserializer, handler.response_serializer)


def _behaviour(handler):
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def start_server(backend: AgentBackend, cfg: ServerConfig = ServerConfig()) -> tuple[grpc.Server, int]:
    """Start serving; returns the server and its bound port."""
    verifier = Verifier(cfg.token, cfg.name) if cfg.token else None
    interceptors = [_SignedCalls(verifier)] if verifier else []
    server = grpc.server(
        ThreadPoolExecutor(cfg.threads, thread_name_prefix="cache-agent-rpc"), interceptors=interceptors,
        options=[("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
                 ("grpc.max_send_message_length", 2 * CHUNK_BYTES)],
    )
    agent_pb2_grpc.add_CacheAgentServicer_to_server(_Servicer(backend), server)
    addr = f"{cfg.host}:{cfg.port}"
    if (cfg.tls_cert_chain is None) != (cfg.tls_private_key is None):
        raise ValueError("TLS needs both tls_cert_chain and tls_private_key")
    if cfg.tls_client_ca is not None and cfg.tls_cert_chain is None:
        raise ValueError("mutual TLS (tls_client_ca) needs the agent's own tls_cert_chain and tls_private_key")
    if cfg.tls_cert_chain is not None:
        creds = grpc.ssl_server_credentials([(cfg.tls_private_key, cfg.tls_cert_chain)], cfg.tls_client_ca,
                                            require_client_auth=cfg.tls_client_ca is not None)
        port = server.add_secure_port(addr, creds)
    else:
        port = server.add_insecure_port(addr)
    if port == 0:
        raise OSError(f"cache agent could not bind {addr}")
    if verifier is not None:
        verifier.addresses = {f"{h}:{port}" for h in (cfg.host, *cfg.advertise_hosts)} - {f"0.0.0.0:{port}"}
    server.start()
    return server, port
