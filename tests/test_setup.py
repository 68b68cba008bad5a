"""scripts/setup.sh's package installs: uv told pip's settings, and pip where uv fails.

Its helpers run here in bash against a stand-in ``pip`` (its ``config list`` is the machine's
pip configuration) and ``uv``, both recording how they were called.
"""

from __future__ import annotations

import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG_LIST = """global.constraint='/etc/site/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/from-global'
install.find-links='/opt/from-install'
:env:.find-links='/opt/from-env'
:env:.default-timeout='180'
"""


def _install_helpers() -> str:
    """setup.sh from ``pip_setting`` through ``install``: the helpers and the uv arguments."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    found = re.search(r"^pip_setting\(\) \{.*?^install\(\) \{.*?^\}\n", text, re.S | re.M)
    assert found, "setup.sh lost its pip_setting / install helpers"
    return found.group(0)


def _script(path: Path, text: str) -> None:
    """An executable shell script at ``path``."""
    path.write_text(text)
    path.chmod(0o755)


def _run(tmp_path: Path, uv_exit: int | None, config: str = CONFIG_LIST) -> list[str]:
    """The calls of ``install -e .[test]``; ``uv_exit`` None: no uv (it has no build for the machine)."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    log = tmp_path / "calls"
    _script(venv / "pip", f"""#!/bin/sh
if [ "$1 $2" = "config list" ]; then cat <<'EOF'
{config}EOF
else echo "pip $*" >>{log}; fi
""")
    if uv_exit is not None:
        _script(venv / "uv", f'#!/bin/sh\necho "uv $*" >>{log}\nexit {uv_exit}\n')
    script = (f'set -euo pipefail\nPYTHON={sys.executable}\nVENV={tmp_path / "venv"}\nPIP="$VENV/bin/pip"\n'
              + _install_helpers() + 'install -e ".[test]"\n')
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return log.read_text().splitlines()


def test_uv_gets_pips_indexes_find_links_and_constraints_in_pips_order(tmp_path):
    (uv,) = _run(tmp_path, uv_exit=0)
    args = uv.split()
    assert args[:3] == ["uv", "pip", "install"] and args[-2:] == ["-e", ".[test]"]
    assert "--compile-bytecode" in args  # as pip does: modules are not compiled again in every process
    pairs = list(pairwise(args))
    assert ("--index-strategy", "unsafe-best-match") in pairs  # the best version over all indexes, as pip
    assert [v for k, v in pairs if k == "--extra-index-url"] == ["file:///opt/a/simple", "file:///opt/b/simple"]
    assert [v for k, v in pairs if k == "--find-links"] == ["/opt/from-env"]  # PIP_* before the files
    assert [v for k, v in pairs if k == "--constraint"] == ["/etc/site/constraints.txt"]
    assert "--index-url" not in args  # none set: uv's default, PyPI


def test_pip_installs_what_uv_could_not(tmp_path):
    uv, pip = _run(tmp_path, uv_exit=1)
    assert uv.startswith("uv pip install") and pip == "pip install -q -e .[test]"


def test_pip_installs_everything_without_uv(tmp_path):
    assert _run(tmp_path, uv_exit=None) == ["pip install -q -e .[test]"]


def test_an_install_sections_setting_comes_before_the_global_one(tmp_path):
    config = "".join(line + "\n" for line in CONFIG_LIST.splitlines() if not line.startswith(":env:.find-links"))
    (uv,) = _run(tmp_path, uv_exit=0, config=config)
    args = uv.split()
    assert [v for k, v in pairwise(args) if k == "--find-links"] == ["/opt/from-install"]


def _apt_installs(tmp_path: Path, present: tuple[str, ...]) -> list[str]:
    """setup.sh's apt block run with only ``present`` of its tools (and a stand-in apt-get that
    records its calls) on PATH; the calls, in order."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    found = re.search(r"^apt_missing=\(\)\n.*?^fi\n", text, re.S | re.M)
    assert found, "setup.sh lost its apt block"
    bin_dir, log = tmp_path / "bin", tmp_path / "apt-calls"
    bin_dir.mkdir(parents=True)
    for tool in (*present, "apt-get"):
        _script(bin_dir / tool, f'#!/bin/sh\necho "{tool} $*" >>{log}\n')
    _script(bin_dir / "id", "#!/bin/sh\necho 0\n")  # as root: no sudo
    r = subprocess.run(["/bin/bash", "-c", "set -euo pipefail\n" + found.group(0)], capture_output=True, text=True,
                       timeout=60, env={"PATH": str(bin_dir)})
    assert r.returncode == 0, r.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_setup_installs_with_apt_only_what_the_machine_lacks(tmp_path):
    """redis-server (the directory) and a C++ compiler (the CPU decode kernels; without one the
    engine runs their slower torch references), each only when missing."""
    assert _apt_installs(tmp_path / "both", ("redis-server", "c++")) == []
    calls = _apt_installs(tmp_path / "no-compiler", ("redis-server",))
    assert calls[-1].split()[-1:] == ["g++"] and "redis-server" not in calls[-1]
    calls = _apt_installs(tmp_path / "bare", ())
    assert calls[0] == "apt-get update -qq" and calls[-1].split()[-2:] == ["redis-server", "g++"]
