"""Ragged paged attention: prefill chunks, speculative decoding and decode in one call.

``api.py`` (validation, implementation choice, the public `paged_attention`), ``pallas_triton.py``
(the Pallas Triton kernel), ``xla.py`` (plain jnp), ``configs.py`` (the kernel's config, heuristic
and tuned table).
"""
