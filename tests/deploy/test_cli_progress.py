"""What `tide up` shows while replicas start, and `tide --version`."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from importlib.metadata import version

from rich.console import Console

from deploy.cli import _startup_view


def test_startup_view_shows_each_replicas_shard_bytes_and_stage():
    console = Console(record=True, width=120, force_terminal=True)
    live, show = _startup_view(console)
    show({"SERVE_REPLICA::tideserve#LLMServer#ab12": {"stage": "loading weights", "bytes": 1_500_000,
                                                       "total_bytes": 3_000_000, "shards": 1, "total_shards": 3},
          "SERVE_REPLICA::tideserve#LLMDecode#cd34": {"stage": "building CPU kernels"}})
    table = live.get_renderable()
    live.stop()
    text = Console(width=120, record=True)
    text.print(table)
    out = text.export_text()
    assert "ab12" in out and "shard 2/3" in out and "1.5/3.0 MB (50%)" in out
    assert "cd34" in out and "building CPU kernels" in out


def test_version():
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"tideserve {version('tideserve')}"


def test_without_a_terminal_each_stage_a_replica_enters_is_one_line():
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    live, show = _startup_view(console)
    a, b = "SERVE_REPLICA::tideserve#LLMServer#ab12", "SERVE_REPLICA::tideserve#LLMDecode#cd34"
    show({a: {"stage": "loading weights", "bytes": 1, "total_bytes": 3, "shards": 0, "total_shards": 1}})
    show({a: {"stage": "loading weights", "bytes": 2, "total_bytes": 3, "shards": 0, "total_shards": 1},
          b: {"stage": "warming up"}})
    show({a: {"stage": "ready"}, b: {"stage": "warming up"}})
    assert not live.is_started
    lines = re.findall(r"replica \S+: \w+(?: \w+)*", console.file.getvalue())
    assert lines == ["replica LLMServer#ab12: loading weights", "replica LLMDecode#cd34: warming up",
                     "replica LLMServer#ab12: ready"], lines
