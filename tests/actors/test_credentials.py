"""Credentials read on the node (actors/credentials.py): by name, never by value in a config."""

from __future__ import annotations

import pytest

from actors.credentials import agent_token, directory_password
from actors.replica_config import AgentSection, DirectorySection, StoreSection

STORE = StoreSection("/unused")


def _agents(**kw) -> AgentSection:
    return AgentSection(STORE, **kw)


def test_a_password_comes_from_the_env_var_the_config_names(monkeypatch):
    monkeypatch.setenv("TIDE_TEST_PW", "from-env")
    assert directory_password(DirectorySection(password_env="TIDE_TEST_PW")) == "from-env"
    assert directory_password(DirectorySection()) is None
    monkeypatch.delenv("TIDE_TEST_PW")
    with pytest.raises(ValueError, match="TIDE_TEST_PW.*not set on this node"):
        directory_password(DirectorySection(password_env="TIDE_TEST_PW"))


def test_the_agent_token_comes_from_its_file_or_env_var(tmp_path, monkeypatch):
    path = tmp_path / "agent.token"
    path.write_text("token-from-a-file-0123\n")
    path.chmod(0o600)
    assert agent_token(_agents(token_file=str(path))) == "token-from-a-file-0123"
    monkeypatch.setenv("TIDE_TEST_TOKEN", "token-from-env")
    assert agent_token(_agents(token_env="TIDE_TEST_TOKEN")) == "token-from-env"
    assert agent_token(_agents(token="literal")) == "literal" and agent_token(_agents()) is None
    path.chmod(0o644)
    with pytest.raises(ValueError, match="agent token file .* readable by others"):
        agent_token(_agents(token_file=str(path)))
    with pytest.raises(ValueError, match="agent token file .*No such file"):
        agent_token(_agents(token_file=str(tmp_path / "missing")))


def test_a_cache_without_a_secret_is_named_at_start():
    """Units without a MAC are accepted as valid from anyone who can write them: a replica with
    a cache and no secret says so (one without a cache, or with a secret, says nothing)."""
    from actors.llm_server import secret_warning

    assert "cache_secret_file" in secret_warning(True, b"")
    assert secret_warning(True, b"s" * 32) is None and secret_warning(False, b"") is None
