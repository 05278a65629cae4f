#!/usr/bin/env bash
# A folder from which the benchmarks against the real engines import vLLM 0.33's prefix cache
# (`vllm.v1.core.kv_cache_manager`) and SGLang 0.5.23's radix cache
# (`sglang.srt.mem_cache.radix_cache`) on this CPU machine, without installing either into .venv:
# their wheels pull a CUDA build of torch, which this machine neither has nor needs here.
#     bash scripts/real_engines_env.sh /tmp/engines      (about 550 MB, a minute or two)
#     .venv/bin/python benchmarks/block_hash_vs_real_vllm.py --engines-path /tmp/engines
#     .venv/bin/python benchmarks/radix_vs_real_sglang.py --engines-path /tmp/engines
# The folder holds both engines' Python sources (no compiled parts) and the pure-Python packages
# their imports of those modules reach, each installed without its own dependencies; .venv's
# torch and NumPy serve all. Nothing from it is used by the package, its tests or the book.
set -euo pipefail
DIR=${1:?usage: bash scripts/real_engines_env.sh DIR}
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
mkdir -p "$DIR"
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download -q --no-deps -d "$WHEELS" vllm==0.33.0 sglang==0.5.23
for wheel in "$WHEELS"/vllm-0.33.0-*.whl "$WHEELS"/sglang-0.5.23-*.whl; do
  (cd "$DIR" && "$PY" -m zipfile -e "$wheel" .)
done
find "$DIR/vllm" "$DIR/sglang" -name '*.so' -delete
"$PY" -m pip install -q --no-deps --target "$DIR" \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
  annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 cachetools==8.0.2 cbor2==6.3.0 \
  click==8.5.1 cloudpickle==3.1.3 compressed-tensors==0.20.1 dill==0.4.1 fastapi==0.165.0 \
  frozenlist==1.8.0 fsspec==2026.9.0 gguf==0.19.0 hf-xet==1.8.0 httpcore2==2.16.2 \
  httpx2==2.16.2 huggingface-hub==2.4.0 llguidance==1.9.1 loguru==0.7.3 markdown-it-py==4.3.0 \
  mdurl==0.1.2 msgpack==1.2.4 msgspec==0.23.0 multidict==7.2.1 openai==3.57.0 orjson==3.13.0 \
  openai-harmony==0.0.8 opentelemetry-api==1.45.2 packaging==26.4 \
  partial-json-parser==0.2.1.1.post7 propcache==0.5.4 py-cpuinfo==9.0.0 pybase64==1.5.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 pygments==2.21.0 pyyaml==6.0.4 regex==2026.11.19 \
  rich==15.0.0 safetensors==0.8.0 sentencepiece==0.2.3 shellingham==1.5.4 sniffio==1.3.1 \
  starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.24.0 truststore==0.10.5 \
  typer==0.29.2 typing-inspection==0.4.5 uvloop==0.23.0 xgrammar==0.2.9 yarl==1.25.1
PYTHONPATH="$DIR" "$PY" -c 'import vllm.v1.core.kv_cache_manager' 2>/dev/null
PYTHONPATH="$DIR:$PWD/benchmarks:$PWD" "$PY" -c 'import sys, radix_vs_real_sglang as r
sys.meta_path.insert(0, r._TorchvisionStub())
import sglang.srt.mem_cache.radix_cache' 2>/dev/null
echo "vLLM 0.33.0's prefix cache and SGLang 0.5.23's radix cache import from $DIR"
