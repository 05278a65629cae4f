"""Code the book runs that is not part of a serving cache; not loaded by ``import kvcache``.

- `tp_attention`: tensor-parallel attention over N processes (``python -m
  kvcache.examples.tp_attention --help``), run by the tensor-parallel chapter.
- `source_radix`: the study guide's radix manager, rewritten to run a workload (and its
  page-aware port): the baseline the appendix "Against SGLang, vLLM and mini-sglang" times.
- `sglang_standin`, `vllm_standin`: our re-implementations of the designs of SGLang's radix cache
  and vLLM's prefix cache behind this package's manager API, timed against the package's
  managers in the same appendix and in ``benchmarks/``.
"""
