#!/usr/bin/env bash
# Sets up (scripts/setup.sh; quick when nothing changed) and runs the test suite. Extra arguments
# go to pytest.
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --fast    the inner loop: tests that need no Ray cluster and are not marked slow
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -m "not ray and not slow" "$@"
fi
exec .venv/bin/python -m pytest "$@"
