#!/usr/bin/env bash
# The steps of `make gpu-record`, for one Python that already holds torch (with CUDA), Triton,
# pytest and hypothesis: `make gpu-record` runs it with the .venv's python after `make setup`;
# on a machine with no package registry (a lent GPU box), run it with that machine's own python:
#     bash scripts/gpu_record.sh python3
# The benchmarks run first, since the measurement is what a GPU session is for (each checks the
# kernels' output against torch before it times them), then the GPU tests. Every step runs, each
# under its own timeout (300 s in all); the script fails if any failed. A benchmark stopped by its
# timeout leaves what it measured, marked "complete": false.
#
# It writes the second GPU record beside the first (book/data/*_gpu.json, 2026-12-01, commit
# 54d1a6f), which it never touches: store_kv_gpu_v2.json, paged_decode_gpu_v2.json and
# host_cost_gpu_v2.json. The appendix (book/23_against_engines.ipynb) plots v2 beside v1 once the
# files exist.
set -uo pipefail
PY=${1:-.venv/bin/python}
DATA=${GPU_DATA:-book/data}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET # the kernels are compiled for the GPU, never interpreted
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu-record: torch " + torch.__version__ + " sees no CUDA device; nothing recorded")' || exit 1
mkdir -p "$DATA"
rc=0
step() { # step SECONDS COMMAND...: run it under a timeout, remember a failure, go on
  local limit=$1
  shift
  echo "== $* (at most ${limit} s)"
  timeout "$limit" "$@" || { echo "== FAILED (exit $?): $*" >&2; rc=1; }
}
step 60 "$PY" benchmarks/store_kv.py --dtypes bfloat16 --out "$DATA/store_kv_gpu_v2.json"
step 140 "$PY" benchmarks/paged_decode.py --splits-sweep 1 2 4 8 16 \
  --out "$DATA/paged_decode_gpu_v2.json"
step 15 "$PY" benchmarks/host_cost.py --out "$DATA/host_cost_gpu_v2.json"
step 85 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_store_cache.py tests/kernels/test_attention.py tests/kernels/test_kernel_views.py
if [ "$rc" -eq 0 ]; then
  echo "recorded $DATA/{store_kv,paged_decode,host_cost}_gpu_v2.json: commit them, then re-execute book/23_against_engines.ipynb on a CPU (TRITON_INTERPRET=1)"
else
  echo "gpu-record: a step failed (see above); what was recorded is in $DATA/*_gpu_v2.json" >&2
fi
exit "$rc"
