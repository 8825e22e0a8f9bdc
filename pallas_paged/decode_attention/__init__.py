"""Paged decode attention: one query per sequence over its paged K/V.

``api.py`` (validation, implementation choice, the public `decode`), ``pallas_triton.py`` (the
Pallas Triton kernel), ``xla.py`` (plain jnp), ``configs.py`` (the kernel's config, heuristic and
tuned table).
"""
