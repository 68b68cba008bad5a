"""The admin commands start without torch: `tide status`, `tide cache ...`, `tide scale ...` run from
cron and by hand, and argument errors come back before anything heavy is imported (importing
torch alone takes seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# modules that admin commands (not generate / train / bench) import to do their work; the request
# routers too: every command connects with serve.status(), which loads the app's routers
ADMIN_MODULES = ["deploy.cli", "deploy.local", "deploy.cache_cli", "deploy.status_cli", "deploy.scale_cli",
                 "deploy.eplb_cli", "deploy.train_cli", "deploy.schedule_cli", "deploy.stats_cli",
                 "deploy.tidal", "deploy.options", "actors.cache_agent", "actors.tidal", "model.default", "model.config",
                 "deploy.prefill_router", "deploy.decode_router"]

_PROBE = """
import json, sys
from deploy.cli import app
try:
    app(sys.argv[1:], standalone_mode=False)
except Exception as e:
    print(type(e).__name__, file=sys.stderr)
print(json.dumps(sorted(m for m in ("torch", "triton", "transformers") if m in sys.modules)))
"""


def _heavy_after(code: str, *args: str, home) -> list[str]:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "TIDE_HOME": str(home)})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("modules", [ADMIN_MODULES, ["deploy.openai_api"]], ids=["admin", "ingress"])
def test_admin_and_ingress_modules_do_not_import_torch(tmp_path, modules):
    """The ingress replicas (``deploy.openai_api``) tokenize, route and stream: torch would cost
    each of them seconds to start and hundreds of MB."""
    code = ";".join(f"import {m}" for m in modules)
    code += "\nimport json, sys; print(json.dumps([m for m in ('torch', 'triton') if m in sys.modules]))"
    assert _heavy_after(code, home=tmp_path) == []


@pytest.mark.parametrize("args", [["up", "--dtype", "int3"], ["up", "--device", "tpu"], ["down"], ["status"],
                                  ["generate", "--max-tokens", "0"], ["generate", "--device", "tpu"],
                                  ["cache", "stats"], ["scale", "night"], ["eplb", "plan", "--num-slots", "10"]])
def test_argument_errors_and_no_cluster_come_back_without_torch(tmp_path, args):
    assert _heavy_after(_PROBE, *args, home=tmp_path) == []
