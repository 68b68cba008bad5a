"""The ``tide`` command as a user runs it: a child process (``python -m deploy.cli``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def tide(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
         replace_env: bool = False) -> subprocess.CompletedProcess:
    """Run ``tide ARGS`` with this process's environment plus ``env`` (only ``env`` with
    ``replace_env``); past ``timeout`` seconds the test fails with the end of its stderr."""
    full_env = dict(env or {}) if replace_env else {**os.environ, **(env or {})}
    try:
        return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # what it printed says where it hung
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"tide {' '.join(args)} ran past {timeout} s; its stderr ends:\n{err[-3000:]}")
