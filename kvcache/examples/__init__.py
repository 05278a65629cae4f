"""Runnable examples built on the package; not loaded by ``import kvcache``.

`tp_attention`: tensor-parallel attention over N processes (``python -m
kvcache.examples.tp_attention --help``).
"""
