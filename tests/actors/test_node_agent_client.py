"""``NodeAgentClient`` follows its node's agent across a restart (a new port) and retries the
failed call there once; no Ray needed: the agent's address comes from a stand-in ``_resolve``."""

from __future__ import annotations

import pytest

from actors.cache_agent import NodeAgentClient
from cachedir.agent.client import AgentError


class _Agent:
    """An agent client at ``address``: ``down`` ones fail every call, as a dead agent's port does."""

    def __init__(self, address: str, down: bool) -> None:
        self.address, self.down, self.received = address, down, []

    def push(self, encoded_units, replace=frozenset()):
        if self.down:
            next(iter(encoded_units), None)  # a stream starts sending before the connection fails
            raise AgentError(f"agent at {self.address} is gone")
        self.received += list(encoded_units)
        return len(self.received), 0

    def has(self, keys):
        if self.down:
            raise AgentError(f"agent at {self.address} is gone")
        return ["ssd"] * len(keys)


class _Client(NodeAgentClient):
    def __init__(self, addresses: list[str]) -> None:
        self.addresses, self.made = addresses, {}
        super().__init__("node-1", self._agent)

    def _agent(self, address: str) -> _Agent:
        self.made[address] = _Agent(address, down=address == "old:1")
        return self.made[address]

    def _resolve(self) -> str:
        return self.addresses.pop(0) if len(self.addresses) > 1 else self.addresses[0]


def test_a_push_whose_agent_restarted_sends_every_unit_to_the_new_one():
    client = _Client(["old:1", "new:2"])
    units = (bytes([i]) * 8 for i in range(5))  # a generator, as the cluster cache passes
    assert client.push(units) == (5, 0)
    assert client.address == "new:2" and client.made["new:2"].received == [bytes([i]) * 8 for i in range(5)]


def test_a_call_fails_when_the_agent_is_where_it_was():
    client = _Client(["old:1"])
    with pytest.raises(AgentError):
        client.has([b"k"])
    assert client.address == "old:1"
