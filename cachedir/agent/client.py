"""``AgentClient``: calls one node's cache agent. Errors come out as ``AgentError`` (with the gRPC
status code), so callers on a request path can treat any of them as a cache miss."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from cachedir.agent import agent_pb2, agent_pb2_grpc
from cachedir.agent.auth import Signer, body_digest
from cachedir.agent.bulk import fetch_bulk
from cachedir.agent.service import CHUNK_BYTES, MAX_UNIT_BYTES
from cachedir.layout import Loc

__all__ = ["AgentClient", "AgentError", "BulkUnavailable", "ClientPool"]


class AgentError(RuntimeError):
    """A cache agent call failed (unreachable, timed out, refused, or a broken stream)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class BulkUnavailable(AgentError):
    """The agent's bulk port failed where its gRPC answered: its units can still come over gRPC."""


_SERVICE = "/" + agent_pb2.DESCRIPTOR.services_by_name["CacheAgent"].full_name + "/"


class AgentClient:
    def __init__(
        self, address: str, token: str | None = None, root_certificates: bytes | None = None,
        timeout_s: float = 5.0, tls_server_name: str | None = None, name: str = "client",
        client_certificate: tuple[bytes, bytes] | None = None,
    ) -> None:
        """``address`` is ``host:port``; ``root_certificates`` (PEM) switches to TLS, and
        ``client_certificate`` (PEM key, PEM chain) presents this node's certificate (mutual TLS).
        With ``token``, calls are signed as ``name`` and the agent must prove it holds the token
        before a reply is used or a unit is sent (``cachedir.agent.auth``)."""
        self.address = address
        self.timeout_s = timeout_s
        self._signer = Signer(token, name) if token else None
        options = [("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
                   ("grpc.max_send_message_length", 2 * CHUNK_BYTES)]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if client_certificate is not None and root_certificates is None:
            raise ValueError("a client certificate needs root_certificates (TLS)")
        if root_certificates is not None:
            key, chain = client_certificate or (None, None)
            creds = grpc.ssl_channel_credentials(root_certificates, private_key=key, certificate_chain=chain)
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = agent_pb2_grpc.CacheAgentStub(self._channel)

    def _sign(self, method: str, request=None) -> tuple[tuple, str | None]:
        """The call's metadata and nonce, signed for ``request`` (None: a streamed request)."""
        if self._signer is None:
            return (), None
        body = "" if request is None else body_digest(request.SerializeToString(deterministic=True))
        return self._signer.sign(_SERVICE + method, self.address, body)

    def _check_proof(self, call, method: str, nonce: str | None) -> None:
        """Raise unless the agent proved it holds the token (its first metadata)."""
        if nonce is None or self._signer.proven(call.initial_metadata(), _SERVICE + method, nonce) is not None:
            return
        if call.done() and call.code() not in (None, grpc.StatusCode.OK):  # it refused the call
            raise AgentError(f"cache agent {self.address}: {method} failed: {call.code().name} {call.details()}",
                             call.code())
        call.cancel()
        raise AgentError(f"cache agent {self.address}: {method} answered without proof that it holds "
                         "the cluster's agent token (not an agent of this cluster)", grpc.StatusCode.UNAUTHENTICATED)

    def _error(self, e: grpc.RpcError, what: str) -> AgentError:
        code = e.code() if hasattr(e, "code") else None
        detail = e.details() if hasattr(e, "details") else str(e)
        return AgentError(f"cache agent {self.address}: {what} failed: {code.name if code else ''} {detail}", code)

    def fetch(self, keys: Sequence[bytes], requester: str = "",
              max_unit_bytes: int = MAX_UNIT_BYTES) -> list[tuple[str, bytes] | None]:
        """(tier, encoded unit) per key, None where the agent lacks it. Unverified: the caller
        checks each unit against what it expects. A unit may declare at most ``max_unit_bytes``
        (the caller's model's unit and its header): what a peer can make this call hold is
        ``len(keys)`` of them."""
        out: list[tuple[str, bytes] | None] = [None] * len(keys)
        if not keys:
            return out
        request = agent_pb2.FetchRequest(keys=list(keys), requester=requester)
        metadata, nonce = self._sign("Fetch", request)
        try:
            stream = self._stub.Fetch(request, timeout=self.timeout_s, metadata=metadata)
            self._check_proof(stream, "Fetch", nonce)
            for index, tier, data in self._assemble(stream, len(keys), min(max_unit_bytes, MAX_UNIT_BYTES)):
                out[index] = (tier, data)
        except grpc.RpcError as e:
            raise self._error(e, "fetch") from None
        return out

    @staticmethod
    def _assemble(stream: Iterator, n: int, max_unit_bytes: int = MAX_UNIT_BYTES) -> Iterator[tuple[int, str, bytes]]:
        """Units from a Fetch stream. What a peer may make this client hold is bounded: a unit
        declares its size (at most ``max_unit_bytes``) in its first chunk and may not send more."""
        parts: list[bytes] = []
        current = tier = None
        size = got = 0
        for chunk in stream:
            if chunk.index >= n:
                raise AgentError(f"chunk for unit {chunk.index} of a {n}-unit fetch")
            if current is None:
                if chunk.missing:
                    continue
                if not 0 < chunk.size <= max_unit_bytes:
                    raise AgentError(f"unit {chunk.index} declares {chunk.size} bytes (1..{max_unit_bytes})")
                current, tier, size, parts, got = chunk.index, chunk.tier, chunk.size, [], 0
            elif chunk.index != current:
                raise AgentError(f"unit {current} ended without its last chunk")
            got += len(chunk.data)
            if got > size:
                raise AgentError(f"unit {current} sent more than its {size} bytes")
            parts.append(chunk.data)
            if chunk.last:
                data = b"".join(parts)
                if len(data) == size:  # a short unit is dropped (a miss), never used
                    yield current, tier, data
                current = None
        if current is not None:
            raise AgentError(f"stream ended inside unit {current}")

    def has(self, keys: Sequence[bytes]) -> list[str]:
        if not keys:
            return []
        return list(self._unary("Has", agent_pb2.HasRequest(keys=list(keys))).tiers)

    def _unary(self, method: str, request):
        """A signed unary call's reply, once the agent proved it holds the token."""
        metadata, nonce = self._sign(method, request)
        try:
            reply, call = getattr(self._stub, method).with_call(request, timeout=self.timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            raise self._error(e, method.lower()) from None
        self._check_proof(call, method, nonce)
        return reply

    def push(self, encoded_units: Iterable[bytes], replace: frozenset[int] = frozenset()) -> tuple[int, int]:
        """Send units (encoded files); returns (accepted, rejected). The units at the positions in
        ``replace`` replace the agent's copy under their key (which failed its reader's checks)."""

        metadata, nonce = self._sign("Push")
        gate, allowed = threading.Event(), [nonce is None]  # no unit leaves before the agent proved itself
        if nonce is None:
            gate.set()

        def chunks() -> Iterator[agent_pb2.UnitChunk]:
            gate.wait(self.timeout_s / 2)  # a peer that answers only once the stream ends has to, in time
            if not allowed[0]:
                return
            for i, data in enumerate(encoded_units):
                view = memoryview(data)
                n = max(1, -(-len(view) // CHUNK_BYTES))
                for c in range(n):
                    yield agent_pb2.UnitChunk(index=i, data=bytes(view[c * CHUNK_BYTES : (c + 1) * CHUNK_BYTES]),
                                              size=len(view) if c == 0 else 0, last=c == n - 1,
                                              replace=c == 0 and i in replace)

        try:
            call = self._stub.Push.future(chunks(), timeout=self.timeout_s, metadata=metadata)
            try:
                self._check_proof(call, "Push", nonce)
                allowed[0] = True
            finally:
                gate.set()
            reply = call.result()
        except grpc.RpcError as e:
            raise self._error(e, "push") from None
        return reply.accepted, reply.rejected

    def reserve(self, keys: Sequence[bytes], requester: str = "") -> tuple[bytes, int]:
        """A ticket and the port of the agent's bulk listener for ``keys`` (``cachedir.agent.bulk``);
        port 0 where it offers none."""
        reply = self._unary("Reserve", agent_pb2.ReserveRequest(keys=list(keys), requester=requester))
        return reply.ticket, reply.port

    def fetch_bulk(self, keys: Sequence[bytes], requester: str, max_unit_bytes: int,
                   take: Callable[[int], memoryview], connections: int = 4) -> list[tuple[str, memoryview] | None] | None:
        """``fetch``'s answer through the agent's bulk port (None where it offers none): units
        read straight into memory from ``take``, unverified, over up to ``connections``
        connections side by side (a run of the keys each: the agent's disk serves them at a
        queue depth of that many). ``AgentError`` when the agent's ``Reserve`` fails;
        ``BulkUnavailable`` when a bulk connection does (the caller fetches through gRPC then)."""
        n = max(1, min(connections, len(keys) // 4))
        runs = [list(keys[len(keys) * j // n : len(keys) * (j + 1) // n]) for j in range(n)]
        tickets = []
        for run in runs:
            try:
                ticket, port = self.reserve(run, requester)
            except AgentError as e:
                if e.code == grpc.StatusCode.UNIMPLEMENTED:  # an agent without a bulk port
                    return None
                raise
            if not port:
                return None
            tickets.append(ticket)
        host = self.address.rsplit(":", 1)[0].strip("[]")
        limit = min(max_unit_bytes, MAX_UNIT_BYTES)

        def one(run: list[bytes], ticket: bytes) -> list[memoryview | None]:
            return fetch_bulk(host, port, ticket, len(run), limit, take, self.timeout_s)

        try:
            if n == 1:
                got = one(runs[0], tickets[0])
            else:
                with ThreadPoolExecutor(n, thread_name_prefix="bulk-fetch") as pool:
                    got = [u for part in pool.map(one, runs, tickets) for u in part]
        except OSError as e:
            raise BulkUnavailable(f"cache agent {self.address}: bulk fetch failed: {e}") from None
        return [None if data is None else ("ssd", data) for data in got]

    def locate(self, keys: Sequence[bytes]) -> list[tuple[str, Loc] | None]:
        """(tier, where on the agent's SSD) per key, None where it holds none there: for a
        caller on the agent's node, which reads the files itself (and verifies what it reads)."""
        if not keys:
            return []
        reply = self._unary("Locate", agent_pb2.LocateRequest(keys=list(keys)))
        if len(reply.locations) != len(keys):
            raise AgentError(f"cache agent {self.address}: locate answered {len(reply.locations)} of {len(keys)} keys")
        return [(loc.tier, Loc(Path(loc.path), loc.offset, loc.length)) if loc.path else None
                for loc in reply.locations]

    def stats(self) -> dict:
        return json.loads(self._unary("Stats", agent_pb2.StatsRequest()).json)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ClientPool:
    """Clients by address, at most ``limit`` open: the least recently used is closed when another
    address comes (agents that restart listen on new ports, so addresses keep coming)."""

    def __init__(self, make: Callable[[str], AgentClient], limit: int = 64) -> None:
        self._make, self._limit = make, limit
        self._clients: OrderedDict[str, AgentClient] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, address: str) -> AgentClient:
        with self._lock:
            client = self._clients.get(address)
            if client is not None:
                self._clients.move_to_end(address)
                return client
            client = self._clients[address] = self._make(address)
            while len(self._clients) > self._limit:
                _, old = self._clients.popitem(last=False)
                old.close()  # a call still under way on it fails: a miss, as a dead peer's
            return client

    def __len__(self) -> int:
        return len(self._clients)

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
