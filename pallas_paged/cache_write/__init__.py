"""Writing new tokens' K/V into the paged cache.

``api.py`` (validation, implementation choice, the public `write_kv`), ``pallas_triton.py`` (the
row-copy kernel), ``xla.py`` (the scatter), ``fp8.py`` (quantization for fp8 caches).
"""
