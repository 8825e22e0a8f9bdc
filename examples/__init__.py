"""End-to-end example: a Llama-architecture decoder serving requests through the paged KV cache.

Not part of the library package. ``llama.py`` is the model in plain JAX (weights from a
``transformers.LlamaForCausalLM`` state dict), ``paged_cache.py`` the per-layer caches and the
block allocator, ``runner.py`` the scheduler and its jitted, donated step, ``generate.py`` the
command line that checks the runner token for token against Hugging Face ``generate``.
"""
