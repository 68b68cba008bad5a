#!/usr/bin/env bash
# Sets up tideserve on a fresh machine: a virtual environment in .venv with torch (the CPU build
# on machines without CUDA), the package and its test dependencies, the CPU decode kernels, and
# redis-server (and a C++ compiler for the kernels where none is found).
# Usage: scripts/setup.sh            (idempotent and quick when nothing changed; re-run after pulling)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# redis-server is the cache directory; g++ builds the CPU decode kernels (without one the engine
# runs their torch references, several times slower)
apt_missing=()
command -v redis-server >/dev/null 2>&1 || apt_missing+=(redis-server)
command -v c++ >/dev/null 2>&1 || apt_missing+=(g++)
if [ ${#apt_missing[@]} -gt 0 ]; then
  echo "== installing ${apt_missing[*]} (apt)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
fi

# What the install depends on: when none of it changed since the last setup, there is nothing to do.
stamp="$VENV/.tide-setup"
want=$(cat pyproject.toml scripts/setup.sh kernels/cpu_gemv.py kernels/csrc/*.cpp kernels/csrc/*.h | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/tide" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "== $VENV is up to date (scripts/setup.sh: nothing changed since the last setup)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
# Packages install with uv (parallel downloads: the dependencies in seconds where pip takes a
# minute) told pip's settings (indexes, picked from as pip does, find-links, constraints), and
# with pip where uv fails or has no build for the machine.
"$PIP" install -q --upgrade pip uv || "$PIP" install -q --upgrade pip
pip_setting() {  # $1: a pip setting's value as `pip config list` showed it: the environment's
  # (PIP_*) before an [install] section's before a [global] one's
  echo "$pip_config" | "$PYTHON" -c '
import sys
key, found = sys.argv[1], {}
for line in sys.stdin:
    name, _, value = line.rstrip("\n").partition("=")
    found[name] = value.strip("\x27")
print(next((found[f"{section}.{key}"] for section in (":env:", "install", "global") if f"{section}.{key}" in found), ""))
' "$1"
}
pip_config=$("$PIP" config list 2>/dev/null || true)
uv_args=(--python "$VENV/bin/python" --index-strategy unsafe-best-match)
for v in $(pip_setting index-url); do uv_args+=(--index-url "$v"); done
for v in $(pip_setting extra-index-url); do uv_args+=(--extra-index-url "$v"); done
for v in $(pip_setting find-links); do uv_args+=(--find-links "$v"); done
for v in $(pip_setting constraint); do uv_args+=(--constraint "$v"); done
install() {  # compiled to bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set, every process
  # would otherwise compile each module it imports, every time
  "$VENV/bin/uv" pip install -q --compile-bytecode "${uv_args[@]}" "$@" || { echo "== uv failed; pip instead"; "$PIP" install -q "$@"; }
}

# TORCH_BUILD=cuda|cpu chooses the torch build (an image is built where no GPU is); default: by nvidia-smi
TORCH_BUILD=${TORCH_BUILD:-$(command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)}
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ "$TORCH_BUILD" = cuda ]; then
    echo "== installing torch (CUDA build)"
    install "torch>=2.6,<3"
  else
    # An unpinned torch would pull a multi-GB CUDA build; 2.13.0 is the CPU build we test with.
    # Triton is pinned too: tests/kernels/test_hopper_compile.py checks the kernels' tile configs
    # against what this compiler makes of them.
    echo "== installing torch==2.13.0 (CPU build) and triton==3.9.0"
    install "torch==2.13.0" "triton==3.9.0"
  fi
fi

# The CPU decode kernels are built here, once per install (not inside the first replica while
# `tide up` already answers). They need only torch and ninja (pyproject.toml's pin), so they
# compile while the rest installs.
install "ninja>=1.11"
echo "== building the CPU decode kernels (while the rest installs)"
"$VENV/bin/python" -m kernels.cpu_gemv >"$VENV/.tide-kernels.log" 2>&1 &
kernels=$!

# TIDE_EXTRAS: the optional dependencies (default: test; the image takes none)
EXTRAS=${TIDE_EXTRAS-test}
echo "== installing tideserve${EXTRAS:+ and its $EXTRAS dependencies}"
install -e ".${EXTRAS:+[$EXTRAS]}"
# An editable install leaves the package's own modules (pyproject.toml's packages) uncompiled:
# compiled here once, for the same reason as install()'s --compile-bytecode (every Ray worker and
# command imports them)
"$VENV/bin/python" -m compileall -q -j 0 model kernels cachedir cluster actors deploy >/dev/null
if wait "$kernels"; then  # what it did (torch, imported before numpy was installed, warns about it)
  grep -E "^(CPU decode kernels|removed an older build)" "$VENV/.tide-kernels.log" || true
else  # tried again with everything installed; without them the torch references are used
  echo "== building the CPU decode kernels again (the first try failed: $VENV/.tide-kernels.log)"
  "$VENV/bin/python" -m kernels.cpu_gemv || true
fi
echo "$want" >"$stamp"
echo "== done: $VENV/bin/tide --help"
