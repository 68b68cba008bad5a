#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA (a session's lent H200, or your own GPU):
# the Triton kernel tests, the model's GPU tests (CUDA graphs of the decode step too) and expert-shard compute on
# CUDA, then what `tide bench kernels --json` prints.
# It uses the machine's own python3 with its torch and triton (nothing is installed) and the repo
# on PYTHONPATH; it writes env.txt, tests.log and bench-kernels.json under ${OUT:-gpu-check}.
# Without CUDA the tests run in Triton's interpreter and the bench says it needs CUDA.
# Usage: scripts/gpu-check.sh        (about 5 minutes on an H200; TEST_TIMEOUT / BENCH_TIMEOUT in s)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>&1 || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} | tee "$OUT/env.txt"

timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/kernels tests/model/test_gpu.py tests/model/test_fixed_decode.py tests/cluster/test_ep.py \
  "tests/cluster/test_engine.py::test_on_cuda_decode_steps_replay_graphs_and_give_the_eager_engines_tokens" \
  --ignore=tests/kernels/test_cpu_gemv.py 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

# what `tide bench kernels --json` prints, without the CLI: the machine's typer may need pydantic,
# which its image lacks (the tests' and the bench's own modules need neither, nor Ray or Redis)
timeout "${BENCH_TIMEOUT:-300}" "$PY" -c 'import json; from deploy.bench.kernel_bench import run_kernel_bench
print(json.dumps(run_kernel_bench(), indent=2))' | tee "$OUT/bench-kernels.json"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc bench rc=$bench_rc" | tee -a "$OUT/env.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
