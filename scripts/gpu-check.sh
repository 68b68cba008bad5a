#!/usr/bin/env bash
# The GPU checks in one run with a verdict (scripts/gpu_check.py): env, the GPU-marked tests, the
# Triton kernels at DeepSeek-V3's shapes against their references and the device's peak, and MTP
# speculative decoding's speedup, each phase within its budget (550 s in all: on a lent GPU two
# calls, --phases env,tests,mtp then --phases kernels), one JSON line per case and phase, the
# verdict last; exit status 0 on pass. It uses the machine's own python3 with
# its torch and triton (nothing is installed) and the repo on PYTHONPATH; the lines also go to
# ${OUT:-gpu-check}/gpu-check.jsonl.
# Usage: scripts/gpu-check.sh [--dry-run] [--min-efficiency SCALE] [--phases env,tests,kernels,mtp]
#   --dry-run: the same phases on the CPU in Triton's interpreter at toy shapes (no GPU needed)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
case " $* " in *" --dry-run "*) export TRITON_INTERPRET=1 ;; *) unset TRITON_INTERPRET ;; esac
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
