"""How cache-agent calls authenticate: the cluster's agent token never crosses the wire.

A caller signs each call: ``x-tide-auth: <caller>:<time_ms>:<nonce>:<sig>``, where ``sig`` is an
HMAC-SHA256 under the caller's own key (``node_key``: derived from the token and the caller's
name) of the method, the address it dialled, the time, a fresh nonce and the SHA-256 of the
request message (``body_digest``), so a signature covers what it asks for: a captured call's
header cannot carry other keys. A streamed request (``Push``) signs an empty body; each unit it
sends carries its own MAC under the cluster's cache secret. An agent accepts a
signature once (it remembers nonces for the time window), within ``WINDOW_S`` of its own clock,
and only for one of its own addresses, so a captured header cannot be replayed, late or
elsewhere. Before anything else the agent answers with ``x-tide-proof: <name>:<sig>``, an HMAC
of the caller's nonce and the method under the agent's own node key; the caller checks it before
it reads a reply or sends a unit. A listener that merely appears in the directory therefore
learns no credential, gets no unit, and cannot answer as an agent.

The names identify nodes in logs and stats. Every key derives from the one cluster token, so
whoever holds the token can act as any node; per-node isolation needs per-node certificates
(mutual TLS, ``ServerConfig.tls_client_ca``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

__all__ = ["AUTH_HEADER", "PROOF_HEADER", "WINDOW_S", "Signer", "Verifier", "body_digest", "node_key"]

AUTH_HEADER = "x-tide-auth"
PROOF_HEADER = "x-tide-proof"
WINDOW_S = 60.0  # how far a caller's clock may be from the agent's
MAX_NONCES = 1 << 20  # remembered at once; only signed calls get in, so only token holders fill it


def node_key(token: str, name: str) -> bytes:
    """The key ``name`` signs with (callers) and proves itself with (agents)."""
    return hmac.new(token.encode(), b"tide-agent-key\0" + name.encode(), hashlib.sha256).digest()


def body_digest(message: bytes) -> str:
    """What a signature says of a request's body: the SHA-256 of its serialized message (a
    protobuf's ``SerializeToString(deterministic=True)``)."""
    return hashlib.sha256(message).hexdigest()


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def _check_name(name: str) -> str:
    if not name or not name.isascii() or not name.isprintable() or ":" in name:
        raise ValueError(f"agent auth name {name!r} must be printable ASCII without ':'")
    return name


class _Party:
    """One end of a call: the cluster token, its own name and key, a clock."""

    def __init__(self, token: str, name: str, clock: Callable[[], float] = time.time) -> None:
        self._token = token
        self.name = _check_name(name)
        self._key = node_key(token, name)
        self._clock = clock


class Signer(_Party):
    """The caller's side: signs calls as ``name`` and checks the agent's proof."""

    def sign(self, method: str, target: str, body: str = "") -> tuple[tuple[tuple[str, str], ...], str]:
        """The metadata of one call of ``method`` to the agent at ``target`` with the request
        ``body`` (its ``body_digest``; "" for a streamed request), and its nonce."""
        ms, nonce = str(int(self._clock() * 1000)), secrets.token_hex(16)
        sig = _mac(self._key, "call", method, target, ms, nonce, body)
        return ((AUTH_HEADER, f"{self.name}:{ms}:{nonce}:{sig}"),), nonce

    def proven(self, metadata: Iterable[tuple[str, str]] | None, method: str, nonce: str) -> str | None:
        """The agent's name when ``metadata`` proves it holds the token; None when it does not."""
        value = dict(metadata or ()).get(PROOF_HEADER, "")
        name, _, sig = value.rpartition(":")
        if not name:
            return None
        expected = _mac(node_key(self._token, name), "proof", method, nonce)
        return name if hmac.compare_digest(sig.encode(), expected.encode()) else None


class Verifier(_Party):
    """The agent's side: checks a call's signature and makes the proof it answers with."""

    def __init__(self, token: str, name: str, clock: Callable[[], float] = time.time) -> None:
        super().__init__(token, name, clock)
        self.addresses: set[str] = set()  # the agent's own host:port forms (set once bound)
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def verify(self, metadata: Iterable[tuple[str, str]], method: str, body: str = "") -> tuple[str, str]:
        """(caller, nonce) of a call signed for one of ``addresses`` and for the request
        ``body`` (its ``body_digest``; "" for a streamed request), fresh and first seen;
        ``PermissionError`` saying why not."""
        parts = dict(metadata).get(AUTH_HEADER, "").rsplit(":", 3)
        if len(parts) != 4 or not parts[0]:
            raise PermissionError("the call is not signed (x-tide-auth) with the cluster's agent token")
        caller, ms, nonce, sig = parts
        key = node_key(self._token, caller)
        if not any(hmac.compare_digest(sig.encode(), _mac(key, "call", method, t, ms, nonce, body).encode())
                   for t in self.addresses):
            raise PermissionError("the call is not signed with this cluster's agent token, or not for this address "
                                  "and request")
        now = self._clock()
        try:
            skew = abs(now - int(ms) / 1000)
        except ValueError:
            raise PermissionError("malformed signature time") from None
        if skew > WINDOW_S:
            raise PermissionError(f"signature is {skew:.0f} s from this agent's clock (at most {WINDOW_S:.0f})")
        with self._lock:
            while self._nonces and next(iter(self._nonces.values())) < now:
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                raise PermissionError("replayed cache agent signature")
            if len(self._nonces) >= MAX_NONCES:
                raise PermissionError("too many calls in the signature window")
            self._nonces[nonce] = now + 2 * WINDOW_S
        return caller, nonce

    def proof(self, method: str, nonce: str) -> tuple[tuple[str, str], ...]:
        """The metadata that proves this agent to the caller of ``nonce``."""
        return ((PROOF_HEADER, f"{self.name}:{_mac(self._key, 'proof', method, nonce)}"),)
