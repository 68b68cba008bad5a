#!/usr/bin/env bash
# Sets up (scripts/setup.sh; quick when nothing changed) and runs the test suite in
# TIDE_TEST_PROCESSES pytest processes (pytest-xdist; default 2; 0 = all in this one), each group
# of tests (a module, or the modules on one shared Ray: tests/conftest.py) whole in one, the
# longest groups first. Extra arguments go to pytest.
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --fast    the inner loop: tests that need no Ray cluster and are not marked slow
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${1:-}" != "--fast" ] && { ! command -v prometheus >/dev/null 2>&1 || ! command -v fio >/dev/null 2>&1; }; then
  # the dashboard test queries a real Prometheus (not started as a service); the unit-io
  # benchmark's raw baseline is fio's (Debian packages prometheus and fio)
  echo "== installing prometheus and fio (apt)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get install -y -qq --no-install-recommends prometheus fio >/dev/null \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus fio >/dev/null; }
fi
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -n "${TIDE_TEST_PROCESSES:-2}" -m "not ray and not slow" "$@"
fi
exec .venv/bin/python -m pytest -n "${TIDE_TEST_PROCESSES:-2}" "$@"
