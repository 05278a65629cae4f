#!/usr/bin/env bash
# The steps of `make gpu-record`, for one Python that already holds torch (with CUDA), Triton,
# pytest and hypothesis: `make gpu-record` runs it with the .venv's python after `make setup`;
# on a machine with no package registry (a lent GPU box), run it with that machine's own python:
#     bash scripts/gpu_record.sh python3
# Each step runs under a timeout; the whole run takes about 2-3 minutes on one GPU.
set -euo pipefail
PY=${1:-.venv/bin/python}
DATA=${GPU_DATA:-book/data}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET # the kernels are compiled for the GPU, never interpreted
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu-record: torch " + torch.__version__ + " sees no CUDA device; nothing recorded")'
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_store_cache.py tests/test_attention.py tests/test_kernel_views.py
timeout 120 "$PY" benchmarks/store_kv.py --dtypes bfloat16 --out "$DATA/store_kv_gpu.json"
timeout 60 "$PY" benchmarks/paged_decode.py --out "$DATA/paged_decode_gpu.json"
echo "recorded $DATA/store_kv_gpu.json and $DATA/paged_decode_gpu.json: commit them, then make refresh"
