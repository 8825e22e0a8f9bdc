"""Tuned decode configs, keyed by shape class, with the heuristic as the fallback.

A shape class rounds the static facts of a call up to powers of two, so that one measured entry
covers its neighbours: ``(cache dtype, head_dim, group, block_size, batch, capacity)``. Entries are
measured on the device named in ``TUNED_ON`` with ``python -m pallas_paged.bench --tune``; on any
other device, or for a shape class not in the table, `lookup` returns the heuristic config.
"""

from __future__ import annotations

from pallas_paged.config import DecodeConfig, DecodeShape, get_heuristic_config
from pallas_paged.platform import next_power_of_2

# (sm_count of the device the table was measured on)
TUNED_ON = 132

# shape class -> config. Measured with `python -m pallas_paged.bench --tune` on an NVIDIA H200
# (132 SMs), 2026-11-30 (docs/BENCHMARKS.md); only classes where the best candidate beat the
# heuristic are listed.
TUNED: dict[tuple, DecodeConfig] = {
    # fp8_b32_ctx4096: 113.1 us vs 115.8 us heuristic (1.02x)
    ("float8_e4m3fn", 128, 4, 16, 32, 4096): DecodeConfig(block_k=128, num_splits=1, num_warps=4, num_stages=2),
    # d256_b32_ctx4096: 271.3 us vs 378.7 us heuristic (1.40x)
    ("bfloat16", 256, 4, 16, 32, 4096): DecodeConfig(block_k=64, num_splits=1, num_warps=8, num_stages=2),
    # ragged_b64_ctx8192 (lengths uniform in 1..8192): 298.5 us vs 369.4 us heuristic (1.24x)
    ("bfloat16", 128, 4, 16, 64, 8192): DecodeConfig(block_k=128, num_splits=2, num_warps=4, num_stages=2),
    # mha_b32_ctx4096: 518.2 us vs 534.9 us heuristic (1.03x)
    ("bfloat16", 128, 1, 16, 32, 4096): DecodeConfig(block_k=128, num_splits=1, num_warps=4, num_stages=2),
}


def shape_class(shape: DecodeShape) -> tuple:
    """The key a shape is looked up under: its static facts rounded up to powers of two."""
    return (shape.cache_dtype, next_power_of_2(shape.head_dim), next_power_of_2(shape.group),
            shape.block_size, next_power_of_2(shape.batch), next_power_of_2(shape.capacity))


def lookup(shape: DecodeShape, sm_count: int) -> DecodeConfig:
    """The tuned config of ``shape``'s class on this device, else the heuristic one."""
    if sm_count == TUNED_ON:
        config = TUNED.get(shape_class(shape))
        if config is not None:
            return config
    return get_heuristic_config(shape, sm_count)
