"""The ``tide`` command as a user runs it: a child process (``python -m deploy.cli``), or the
same entry point called in this process for commands that start neither Ray nor a child."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

import pytest

# Rich wraps an error panel at the terminal's width (80 columns without a terminal), which can
# split a long path the test looks for.
WIDE = {"COLUMNS": "400"}


def tide(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
         replace_env: bool = False) -> subprocess.CompletedProcess:
    """Run ``tide ARGS`` with this process's environment plus ``env`` (only ``env`` with
    ``replace_env``); past ``timeout`` seconds the test fails with the end of its stderr."""
    full_env = dict(env or {}) if replace_env else {**os.environ, **WIDE, **(env or {})}
    try:
        return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # what it printed says where it hung
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"tide {' '.join(args)} ran past {timeout} s; its stderr ends:\n{err[-3000:]}")


def tide_here(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """Run ``tide ARGS`` through ``deploy.cli.main`` in this process, with ``env`` added to the
    environment while it runs (a None value removes the variable): the same exit status, stdout and stderr as :func:`tide` (an
    uncaught exception prints its traceback and exits 1) without a child's 2-3 s of starting
    Python and importing torch. For commands that start no Ray cluster and no process of their
    own and leave no state behind."""
    from click.testing import CliRunner

    from deploy.cli import main

    with CliRunner().isolation(env={**WIDE, **(env or {})}) as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        return subprocess.CompletedProcess(["tide", *args], code, out.getvalue().decode(errors="replace"),
                                           err.getvalue().decode(errors="replace"))
