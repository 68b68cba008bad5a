"""The app's arguments are checked without the app: ``tide up`` refuses bad ones before it
starts anything, and that check must not pay for importing torch, Ray or the replica."""

from __future__ import annotations

import subprocess
import sys


def test_the_args_and_their_gpus_come_without_torch_or_ray():
    code = ("import sys\n"
            "from deploy.app_args import AppArgs, gpus_needed\n"
            "assert gpus_needed(AppArgs(device='cuda', replicas=2, decode_replicas=1, expert_shards=2)) == 5\n"
            "assert gpus_needed(AppArgs(replicas=4)) == 0\n"
            "print(sorted(m for m in ('torch', 'ray', 'fastapi', 'numpy', 'actors') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
